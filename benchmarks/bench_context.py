"""Context-parallel prefill and the ring, on the GPUs this machine has.

    python -m benchmarks.bench_context --out DIR --part ring1     # one GPU (~2 min on an H100)
    python -m benchmarks.bench_context --out DIR --part cp        # 2+ GPUs: CP=2/4 prefill TTFT
    python -m benchmarks.bench_context --out DIR --part pp        # PP=2 vs TP=2: not built yet
    python -m benchmarks.bench_context --out DIR --smoke [--part cp]  # CPU: does the script run

ring1: the ring over a mesh of one GPU against plain causal flash attention (`kernels.
flash_attention`, whichever backend it picks) at B=1, H=32, KV=8, D=128, bf16, S = 8k, 32k: the
lse kernel first checked against the jnp reference on a small fresh input (its output buffer
poisoned with NaN first, donated), then the ring checked against flash on the timed input, then
medians after warm-up, both timed in this run. The overhead is the ring's (masked tiles, the
float32 output and log-sum-exp, the merge) on top of the kernel.

cp: TTFT of one 128k-token prompt on an 8B-shaped model (random bf16 weights, `--layers` layers,
reported per layer and scaled to 32) with the prefill split over cp = 1, 2, 4 devices
(`sharding.context.ContextParallel`); cp = 1 is the one-GPU baseline timed in the same run.

Writes DIR/sharding_cp.json (records with mode "ring1"/"cp", gpus, gpu, date) and prints a table.
Records for docs/benchmarks/sharding.json are copied from there.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from pallasite import kernels
from pallasite.kernels.flash_lse import attention_lse_reference, flash_attention_lse
from pallasite.sharding.context import shard_map
from pallasite.sharding.ring import ring_attention, zigzag_order

from .common import run_info, time_ms

SMOKE = False  # --smoke: CPU, kernels in interpret mode, tiny shapes (checks the script runs)


def lse_attend(*args, **kw):
    return flash_attention_lse(*args, impl="pallas", interpret=SMOKE, **kw)


def ring_fn(n, devices, causal=True):
    mesh = Mesh(np.array(devices[:n]), ("cp",))
    ring = lambda q, k, v: ring_attention(q, k, v, axis="cp", n=n, causal=causal,
                                          attend=lse_attend)[0]
    spec = P(None, "cp")
    return jax.jit(shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                             check_vma=False))


def check_lse_kernel():
    """The Pallas lse kernel against the reference on a fresh small input, output poisoned."""
    ks = jax.random.split(jax.random.key(int(time.time())), 3)
    S, D = (40, 16) if SMOKE else (1000, 128)
    q = jax.random.normal(ks[0], (1, S, 8, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, S, 2, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, S, 2, D), jnp.bfloat16)
    pos = jnp.asarray(zigzag_order(S, 4)[S // 4:S // 2], jnp.int32)  # a zig-zag block's queries
    kpos = jnp.arange(S, dtype=jnp.int32)
    poison = jnp.full((1, S // 4, 8, D), jnp.nan, jnp.float32)
    fn = jax.jit(lambda out, *a: out.at[:].set(lse_attend(*a)[0]), donate_argnums=0)
    o = fn(poison, q[:, :S // 4], k, v, pos, kpos)
    ref, _ = attention_lse_reference(q[:, :S // 4], k, v, pos, kpos)
    err = float(jnp.max(jnp.abs(o - ref)))
    assert bool(jnp.all(jnp.isfinite(o))) and err < 2e-2, f"lse kernel error {err}"
    return err


def part_ring1(args):
    devices = jax.devices()
    records = [dict(mode="ring1", what="lse kernel vs reference", max_abs_err=check_lse_kernel(),
                    gpus=1, **run_info())]
    ring = ring_fn(1, devices)
    for S in args.ring_lengths:
        ks = jax.random.split(jax.random.key(S), 3)
        D = 16 if SMOKE else 128
        q = jax.random.normal(ks[0], (1, S, 32, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, S, 8, D), jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, S, 8, D), jnp.bfloat16)
        flash = jax.jit(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True,
                                                                interpret=SMOKE))
        want = flash(q, k, v).astype(jnp.float32)
        got = ring(q, k, v)
        err = float(jnp.max(jnp.abs(got - want)))
        assert err < 3e-2, f"ring vs flash at S={S}: {err}"
        flops = 4 * S * S * 32 * D / 2
        t_flash = time_ms(flash, q, k, v, reps=args.reps)
        t_ring = time_ms(ring, q, k, v, reps=args.reps)
        records.append(dict(mode="ring1", S=S, heads=32, kv_heads=8, head_dim=D,
                            flash_ms=t_flash, ring_ms=t_ring, overhead=t_ring / t_flash,
                            ring_tflops=flops / t_ring / 1e9, max_abs_err=err, gpus=1,
                            **run_info()))
    return records


def eight_b(layers):
    from pallasite.model import config_from_dict
    if SMOKE:
        return config_from_dict(dict(model_type="llama", vocab_size=256, hidden_size=64,
                                     intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2))
    return config_from_dict(dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
        rope_theta=500000.0, max_position_embeddings=1 << 20))


def part_cp(args):
    from pallasite.model import init_params
    from pallasite.sharding.context import ContextParallel, cp_mesh
    devices = jax.devices()
    config = eight_b(args.layers)
    L, ps = args.prompt, 16
    pages = L // ps + 8
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, L).astype(np.int32)
    table = np.arange(1, pages - 1, dtype=np.int32)
    records, base, ref_logits = [], None, None
    for n in [c for c in args.cp if c <= len(devices)]:
        cp = ContextParallel(config, cp_mesh(n), ps)
        params = cp.place(init_params(config, seed=0, dtype=jnp.bfloat16))
        shape = (config.num_kv_heads, pages, ps, config.head_dim)
        kv = [tuple(cp.place(jnp.zeros(shape, jnp.bfloat16)) for _ in "kv")
              for _ in range(config.num_layers)]
        logits, kv = cp.prefill(params, kv, tokens, table)  # compile + warm-up
        jax.block_until_ready(logits)
        times = []
        for _ in range(args.reps_cp):
            t = time.perf_counter()
            logits, kv = cp.prefill(params, kv, tokens, table)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t)
        ms = 1e3 * float(np.median(times))
        if ref_logits is None:
            ref_logits, base = np.asarray(logits, np.float32), ms
        err = float(np.max(np.abs(np.asarray(logits, np.float32) - ref_logits)))
        records.append(dict(mode="cp", gpus=n, prompt_tokens=L, layers=config.num_layers,
                            ttft_ms=ms, ttft_ms_32_layers=ms * 32 / config.num_layers,
                            speedup=base / ms, logits_max_abs_diff_vs_cp1=err, **run_info()))
        del params, kv
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=["ring1", "cp", "pp"], default="ring1")
    ap.add_argument("--ring-lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps-cp", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: interpret-mode kernels at S=64, a 2-layer 256-token cp prefill")
    args = ap.parse_args(argv)
    global SMOKE
    SMOKE = args.smoke
    if SMOKE:
        args.ring_lengths, args.reps, args.prompt, args.layers, args.reps_cp = [64], 1, 256, 2, 1
    if args.part == "pp":
        raise SystemExit("pipeline parallelism is not built yet: nothing to measure")
    records = part_ring1(args) if args.part == "ring1" else part_cp(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sharding_cp.json")
    old = json.load(open(path)) if os.path.exists(path) else []
    json.dump(old + records, open(path, "w"), indent=1)
    for r in records:
        keys = [k for k in ("what", "S", "gpus", "flash_ms", "ring_ms", "overhead", "ring_tflops",
                            "ttft_ms", "speedup", "max_abs_err", "logits_max_abs_diff_vs_cp1")
                if k in r]
        print("  ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                        for k in keys))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
