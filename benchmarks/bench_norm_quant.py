"""RMSNorm into a W8A8 product's input: the one-pass kernel (`kernels/norm_quant.py`) against
XLA's passes of the same work, as the model ran it before.

  python -m benchmarks.bench_norm_quant --out DIR            (GPU, under a minute)
  python -m benchmarks.bench_norm_quant --out DIR --smoke    (small shapes, interpreter, CPU)

Per row count M (the 8B shape's residual stream, D 4096), on fresh random inputs, for float8
and int8 rows: without a residual (the first layer's norm), with a bf16 one ("add"), and with a
W8A8 product before its scales ("product": bf16 from FP8, int32 from INT8), as the model now
hands its attention output and MLP output to the next norm:
- "xla": the product's scaling, `x + residual`, the model's `RMSNorm`, then `quantize_rows`
  (XLA's fusions);
- "kernel": `norm_quantize`, checked against `norm_quantize_reference` with freed device memory
  filled with NaN first.
Device times (profiler trace, L2 flushed before each call, `benchmarks/common.py`); the bytes
the pass must move at least (x and the residual read, the sum and the 8-bit row written) over
the kernel time. Writes DIR/bench_norm_quant.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import common
from pallasite import kernels
from pallasite.kernels import norm_quant, quant_reference as qr
from pallasite.model.layers import RMSNorm

D, EPS = 4096, 1e-5


def xla_passes(x, w, res, out):
    """The model's add, norm and row quantization, as XLA fuses them."""
    total = x if res is None else x + qr.value(res)
    h = RMSNorm(x.shape[1], EPS, x.dtype).apply({"params": {"scale": w}}, total)
    q, s = (qr.quantize_rows if out == jnp.float8_e4m3fn else qr.quantize_rows_int8)(h)
    return q, s, (None if res is None else total)


def one(log, m, d, smoke):
    timed = (lambda fn, *a: common.time_ms(fn, *a, reps=1, inner=1)) if smoke else \
        (lambda fn, *a: common.device_ms(fn, *a, reps=10))
    k = jax.random.split(jax.random.key(m), 3)
    x = (jax.random.normal(k[0], (m, d)) * 2).astype(jnp.bfloat16)
    res = jax.random.normal(k[1], (m, d)).astype(jnp.bfloat16)
    w = (jax.random.uniform(k[2], (d,)) + 0.5).astype(jnp.bfloat16)
    row = dict(m=m, d=d)
    raw = jax.random.normal(k[1], (m, d)) * 50
    scales = (jax.random.uniform(k[2], (m, 1)) * 0.01 + 1e-3,
              jax.random.uniform(k[0], (1, d)) * 0.01 + 1e-3)
    for name, out in (("fp8", jnp.float8_e4m3fn), ("int8", jnp.int8)):
        p = raw.astype(jnp.bfloat16) if name == "fp8" else jnp.round(raw).astype(jnp.int32)
        for kind, r in (("norm", None), ("add", res),
                        ("product", qr.Product(p, *scales, jnp.bfloat16))):
            fn = jax.jit(lambda x, w, r, out=out: kernels.norm_quantize(
                x, w, r, eps=EPS, out=out, interpret=smoke))
            if not smoke:
                common.poison()
            rows, total = fn(x, w, r)
            rq, rs, _ = norm_quant.norm_quantize_reference(x, w, qr.value(r), eps=EPS, out=out)
            err = common.rel_err(rows.q.astype(jnp.float32) * rows.scale,
                                 rq.astype(jnp.float32) * rs)
            if r is not None:
                err = max(err, common.rel_err(total, x + qr.value(r)))
            ms = timed(fn, x, w, r)
            read = 0 if r is None else (r.p if kind == "product" else r).dtype.itemsize
            moved = m * d * (2 + read + (2 if r is not None else 0) + 1) + 4 * m
            xla = timed(jax.jit(lambda x, w, r, out=out: xla_passes(x, w, r, out)), x, w, r)
            key = f"{name}_{kind}"
            row[key] = dict(kernel_ms=ms, xla_ms=xla, speedup_vs_xla=xla / ms, rel_err=err,
                            ok=bool(err < 1e-2), tbps=moved / (ms / 1e3) / 1e12)
            log(f"  M={m} {key}: {row[key]}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="256,768,2048,4096,8192", help="row counts")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter (CPU)")
    args = ap.parse_args()
    log = lambda msg: print(msg, flush=True)
    t0 = time.perf_counter()
    log(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    d = 256 if args.smoke else D
    rows = [one(log, m, d, args.smoke)
            for m in ([8] if args.smoke else [int(v) for v in args.ms.split(",")])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = common.run_info(device=not args.smoke) | dict(
        kernel="norm_quantize", mode="norm_quant", seconds=time.perf_counter() - t0, rows=rows)
    (out / "bench_norm_quant.json").write_text(json.dumps(record, indent=1))
    keys = tuple(f"{a}_{b}" for a in ("fp8", "int8") for b in ("norm", "add", "product"))
    print("\n| M | " + " | ".join(f"{k} XLA ms | kernel ms | vs XLA | TB/s" for k in keys)
          + " |\n|---|" + "---|" * 4 * len(keys))
    for r in rows:
        print(f"| {r['m']} | " + " | ".join(
            f"{r[k]['xla_ms']:.4f} | {r[k]['kernel_ms']:.4f} | {r[k]['speedup_vs_xla']:.2f}x | "
            f"{r[k]['tbps']:.2f}" for k in keys) + " |")
    print(f"{time.perf_counter() - t0:.0f} s")
    if not all(r[k]["ok"] for r in rows for k in keys):
        raise SystemExit("the kernel disagreed with its reference")


if __name__ == "__main__":
    main()
