"""The Mosaic GPU flash kernel's head bands (`kernels/flash_mgpu.py`, `band_kv`) at long
prefill, beside FlashAttention-3 and cuDNN in the same run:

    python -m benchmarks.sweep_flash_band --out DIR    # H100: about 4 minutes

At 16k tokens a batch (B=1 S=16k, B=2 S=8k, B=4 S=4k; 32 query heads, 8 KV heads, head dim 128) each
band size runs: 8 KV heads a band is every head at once (the order before bands), fewer keep
the K/V that the CTAs read at one time within L2. Each output is checked first (memory
poisoned) against the jnp reference on the first KV head's query heads, then timed: the median
GPU time of its kernels with the L2 flushed (`common.device_ms`). Writes DIR/flash_band.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.attention import dense_inputs, try_time
from benchmarks.fa3 import fa3
from pallasite.kernels import flash_mgpu, reference

H, KV, D = 32, 8, 128
CASES = [(1, 16384, True, (8, 4, 2, 1)), (1, 16384, False, (8, 4, 2)),
         (2, 8192, True, (8, 4, 2)), (2, 8192, False, (8, 2)), (4, 4096, False, (8, 2))]


def check(out, q, k, v, causal):
    """Relative error of the first KV head's query heads against the reference."""
    g = H // KV
    ref = reference.attention_reference(q[:, :, :g], k[:, :, :1], v[:, :, :1], causal=causal)
    return common.rel_err(out[:, :, :g], ref)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cases", default=None, help="comma-separated indices into CASES")
    args = ap.parse_args(argv)
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    f, records = fa3(), []
    for B, S, causal, bands in cases:
        q, k, v = dense_inputs(jax.random.key(S + B), B, S, S, H, KV, D, jnp.bfloat16)
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        base = dict(batch=B, seq=S, causal=causal, auto_band=flash_mgpu.band_kv_heads(
            B, S, KV, D, 2, causal))
        times = {}
        if f is not None:
            times["fa3"] = try_time("fa3", lambda q, k, v: f.flash_mha(q, k, v, is_causal=causal),
                                    q, k, v, device=True)
        times["cudnn"] = try_time("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), q, k, v, device=True)
        for band in bands:
            fn = lambda q, k, v, band=band: flash_mgpu.flash_attention(q, k, v, causal=causal,
                                                                       band_kv=band)
            common.poison()
            err = check(jax.jit(fn)(q, k, v), q, k, v, causal)
            ms = common.device_ms(fn, q, k, v, reps=args.reps) if err < 1e-2 else None
            times[f"band {band}"] = ms
            records.append(base | dict(band_kv=band, rel_err=err, ms=ms))
        for name, ms in times.items():
            tf = flops / (ms / 1e3) / 1e12 if ms else float("nan")
            vs = times.get("fa3") / ms if ms and times.get("fa3") else float("nan")
            print(f"B={B} S={S} causal={causal}: {name:8s} {ms or float('nan'):8.3f} ms "
                  f"{tf:6.0f} TFLOP/s  FA3/this {vs:.3f}", flush=True)
        records.append(base | dict(baselines={n: t for n, t in times.items()
                                              if not n.startswith("band")}))
        del q, k, v
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_band.json").write_text(json.dumps(dict(**common.run_info(), records=records),
                                                    indent=1))


if __name__ == "__main__":
    main()
