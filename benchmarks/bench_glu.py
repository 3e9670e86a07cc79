"""SwiGLU between the two W8A8 products of an 8B MLP: the one-pass kernel (`kernels/glu_quant.py`)
against XLA's passes of the same work, and the whole MLP fused against two W8A8 calls.

  python -m benchmarks.bench_glu --out DIR            (GPU, about a minute)
  python -m benchmarks.bench_glu --out DIR --smoke    (small shapes, interpreter, CPU)

Per row count M (Llama-3-8B: d 4096, F 14336), on fresh random inputs:
- "xla": the raw gate/up product scaled, SwiGLU rounded to bf16, then `quantize_rows`, as the
  model ran before the kernel (XLA's fusions);
- "kernel": `glu_quantize` (float8, then int8 from an int32 product), checked against
  `glu_quantize_reference` with freed device memory filled with NaN first;
- "mlp fused" / "mlp apart": `kernels.w8a8_glu` against the two `quant_matmul` calls with the
  SwiGLU between them (FP8 weights stored [N, K]).
Device times (profiler trace, L2 flushed before each call, `benchmarks/common.py`); the bytes
each pass must move at least (the product read once, the 8-bit h written) over the kernel
time. Writes DIR/bench_glu.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import common
from pallasite import kernels
from pallasite.kernels import glu_quant, quant_reference as qr
from pallasite.model import quant

D, F = 4096, 14336


def xla_passes(p, rs, cs):
    """The same work as XLA ran it in the model: the product scaled and rounded to bf16 (the
    gate/up call's output), SwiGLU in bf16, then the rows quantized."""
    y = (p.astype(jnp.float32) * rs[:, :, None] * cs[None]).astype(jnp.bfloat16)
    return qr.quantize_rows(jax.nn.silu(y[:, 0]) * y[:, 1])


def mlp_weights(d, f):
    ops = []
    for i, (k, n) in enumerate(((d, 2 * f), (f, d))):
        w = jax.random.normal(jax.random.key(10 + i), (k, n), jnp.bfloat16) * k ** -0.5
        ops.append(quant.operands(quant.quantize_linear(w, (0, 1)), 1))
    return ops


def mlp_apart(x, gu, dn):
    y = kernels.quant_matmul(x, *gu[:3], mode="w8a8", layout=gu[3]).reshape(x.shape[0], 2, -1)
    return kernels.quant_matmul(jax.nn.silu(y[:, 0]) * y[:, 1], *dn[:3], mode="w8a8",
                                layout=dn[3])


def one(log, m, d, f, smoke, warps=(), mlp=True):
    timed = (lambda fn, *a: common.time_ms(fn, *a, reps=1, inner=1)) if smoke else \
        (lambda fn, *a: common.device_ms(fn, *a, reps=10))
    k = jax.random.split(jax.random.key(m), 4)
    rs = jax.random.uniform(k[1], (m, 1)) * 0.01 + 1e-3
    cs = jax.random.uniform(k[2], (2, f)) * 0.01 + 1e-3
    row = dict(m=m, d=d, f=f)
    for name, out, pdt in (("fp8", jnp.float8_e4m3fn, jnp.bfloat16), ("int8", jnp.int8, jnp.int32)):
        p = (jax.random.normal(k[0], (m, 2, f)) * 300).astype(pdt)
        fn = jax.jit(lambda p, rs, cs, out=out: glu_quant.glu_quantize(p, rs, cs, out=out,
                                                                      interpret=smoke))
        if not smoke:
            common.poison()
        hq, hs = fn(p, rs, cs)
        rq, rsc = glu_quant.glu_quantize_reference(p, rs, cs, out=out)
        err = common.rel_err(hq.astype(jnp.float32) * hs, rq.astype(jnp.float32) * rsc)
        ms = timed(fn, p, rs, cs)
        moved = p.size * p.dtype.itemsize + m * f + 4 * m
        row[name] = dict(kernel_ms=ms, rel_err=err, ok=bool(err < 1e-2),
                         tbps=moved / (ms / 1e3) / 1e12)
        if name == "fp8":
            row[name]["xla_ms"] = timed(jax.jit(xla_passes), p, rs, cs)
            row[name]["speedup_vs_xla"] = row[name]["xla_ms"] / ms
            for w in warps:  # the kernel's warps a program (a row's registers spread thinner)
                row[name][f"warps{w}_ms"] = timed(jax.jit(functools.partial(
                    glu_quant.glu_quantize, num_warps=w, interpret=smoke)), p, rs, cs)
        log(f"  M={m} {name}: {row[name]}")
    if not mlp:
        return row
    gu, dn = mlp_weights(d, f)
    x = jax.random.normal(k[3], (m, d), jnp.bfloat16)
    fused = jax.jit(lambda x: kernels.w8a8_glu(x, gu, dn, mode="w8a8", interpret=smoke))
    apart = jax.jit(lambda x: mlp_apart(x, gu, dn))
    row["mlp"] = dict(fused_ms=timed(fused, x), apart_ms=timed(apart, x),
                      rel_err=common.rel_err(fused(x), apart(x)))
    row["mlp"]["speedup"] = row["mlp"]["apart_ms"] / row["mlp"]["fused_ms"]
    log(f"  M={m} mlp: {row['mlp']}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="256,2048,4096,8192", help="row counts")
    ap.add_argument("--warps", default="", help="num_warps values to time the float8 kernel "
                    "with besides its default")
    ap.add_argument("--no-mlp", action="store_true", help="the SwiGLU step only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter (CPU)")
    args = ap.parse_args()
    log = lambda msg: print(msg, flush=True)
    t0 = time.perf_counter()
    log(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    d, f = (256, 384) if args.smoke else (D, F)
    warps = [int(w) for w in args.warps.split(",") if w]
    rows = [one(log, m, d, f, args.smoke, warps, not args.no_mlp)
            for m in ([8] if args.smoke else [int(v) for v in args.ms.split(",")])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = common.run_info(device=not args.smoke) | dict(
        kernel="glu_quantize", mode="glu", seconds=time.perf_counter() - t0, rows=rows)
    (out / "bench_glu.json").write_text(json.dumps(record, indent=1))
    print("\n| M | XLA passes ms | kernel fp8 ms | vs XLA | TB/s | int8 ms | MLP apart ms | "
          "MLP fused ms | MLP speedup |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b, c = r["fp8"], r["int8"], r.get("mlp", dict(apart_ms=0, fused_ms=0, speedup=0))
        print(f"| {r['m']} | {a['xla_ms']:.4f} | {a['kernel_ms']:.4f} | "
              f"{a['speedup_vs_xla']:.2f}x | {a['tbps']:.2f} | {b['kernel_ms']:.4f} | "
              f"{c['apart_ms']:.4f} | {c['fused_ms']:.4f} | {c['speedup']:.2f}x |")
        print("  warps: " + ", ".join(f"{k[5:-3]}: {v:.4f} ms" for k, v in a.items()
                                      if k.startswith("warps")))
    print(f"{time.perf_counter() - t0:.0f} s")
    if not all(r[k]["ok"] for r in rows for k in ("fp8", "int8")):
        raise SystemExit("the kernel disagreed with its reference")


if __name__ == "__main__":
    main()
