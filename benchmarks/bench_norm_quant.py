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
and the norm alone in bf16 ("bf16_norm", "bf16_add": `kernels.add_norm`, as the paged step's
norms run for products that take bf16 rows), where XLA makes three kernels of it;
- "kernel": `norm_quantize`, checked against `norm_quantize_reference` with freed device memory
  filled with NaN first.
Device times (profiler trace, L2 flushed before each call, `benchmarks/common.py`); the bytes
the pass must move at least (x and the residual read, the sum and the 8-bit row written) over
the kernel time. Then the model: two layers of the 8B shape with FP8 and INT8 weights (fused,
random), a paged step of a 512-token prompt (W8A8 rows) and one of two decode rows (weight-only
products), each with the norms' kernels on and off (`PALLASITE_W8A8_NORM`,
`PALLASITE_ADD_NORM`): the logits' relative difference. Writes DIR/bench_norm_quant.json.
"""

from __future__ import annotations

import argparse
import json
import os
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
    if out is None:
        return h, None, (None if res is None else total)
    q, s = qr.quantize_rows_as(h, out)
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
    for name, out in (("bf16", None), ("fp8", jnp.float8_e4m3fn), ("int8", jnp.int8)):
        p = raw.astype(jnp.bfloat16) if name != "int8" else jnp.round(raw).astype(jnp.int32)
        for kind, r in (("norm", None), ("add", res),
                        ("product", qr.Product(p, *scales, jnp.bfloat16))):
            if out is None and kind == "product":
                continue
            fn = jax.jit(lambda x, w, r, out=out: kernels.norm_quantize(
                x, w, r, eps=EPS, out=out, interpret=smoke))
            if not smoke:
                common.poison()
            rows, total = fn(x, w, r)
            rq, rs, _ = norm_quant.norm_quantize_reference(x, w, qr.value(r), eps=EPS, out=out)
            err = (common.rel_err(rows, rq) if out is None else
                   common.rel_err(rows.q.astype(jnp.float32) * rows.scale,
                                  rq.astype(jnp.float32) * rs))
            if r is not None:
                err = max(err, common.rel_err(total, x + qr.value(r)))
            ms = timed(fn, x, w, r)
            read = 0 if r is None else (r.p if kind == "product" else r).dtype.itemsize
            moved = m * d * (2 + read + (2 if r is not None else 0) + (1 if out else 2)) + 4 * m
            xla = timed(jax.jit(lambda x, w, r, out=out: xla_passes(x, w, r, out)), x, w, r)
            key = f"{name}_{kind}"
            row[key] = dict(kernel_ms=ms, xla_ms=xla, speedup_vs_xla=xla / ms, rel_err=err,
                            ok=bool(err < 1e-2), tbps=moved / (ms / 1e3) / 1e12)
            log(f"  M={m} {key}: {row[key]}")
    return row


def model_check(log, smoke):
    """The paged step's logits with the norms' kernels on against off, per weight kind."""
    import numpy as np
    from benchmarks.bench_quant import LLAMA3_8B, TINY
    from pallasite.model import Batch, config_from_dict, forward, init_kv_cache, init_params
    from pallasite.model import quant
    from pallasite.model.fuse import fuse_params
    config = config_from_dict(dict(TINY if smoke else LLAMA3_8B, num_hidden_layers=2))
    plain = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    rng, ps, out, real = np.random.default_rng(0), 16, {}, kernels.norm_quantize
    for scheme in ("fp8", "int8"):
        params = fuse_params(quant.quantize_params(plain, scheme))
        for name, lens in (("prefill 512", [512]), ("decode 2 rows", [1, 1])):
            n, ctx = len(lens), 512
            qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            pos = np.concatenate([np.arange(ctx - q, ctx) for q in lens]).astype(np.int32)
            table = np.arange(n * 40, dtype=np.int32).reshape(n, 40)
            seq = np.repeat(np.arange(n), lens)
            batch = Batch(*(jnp.asarray(a, jnp.int32) for a in (
                qs, np.full(n, ctx), table, table[seq, pos // ps] * ps + pos % ps, qs[1:] - 1)))
            tokens = jnp.asarray(rng.integers(0, config.vocab_size, len(pos)), jnp.int32)
            kv = [tuple(jax.random.normal(jax.random.key(i), a.shape, a.dtype) for a in layer)
                  for i, layer in enumerate(init_kv_cache(config, n * 40, ps, jnp.bfloat16))]
            logits, calls = {}, {}
            for on in ("0", "1"):
                os.environ["PALLASITE_W8A8_NORM"] = os.environ["PALLASITE_ADD_NORM"] = on
                seen = []  # the norms' calls while tracing: which path the step took
                traced = lambda *a, **k: seen.append(str(k["out"])) or real(*a, **k)
                kernels.norm_quantize = traced
                step = jax.jit(lambda p, kv: forward(p, config, tokens, jnp.asarray(pos), kv,
                                                     batch)[0])
                logits[on], calls[on] = step(params, kv), seen
                kernels.norm_quantize = real
            err = common.rel_err(logits["1"], logits["0"])
            out[f"{scheme} {name}"] = dict(rel_err=err, ok=bool(err < 2e-2 and calls["1"]),
                                           norm_calls=calls)
            log(f"  model, {scheme} weights, {name}: kernels on vs off, rel err {err:.2e}; "
                f"norm calls on {calls['1']}, off {calls['0']}")
    for v in ("PALLASITE_W8A8_NORM", "PALLASITE_ADD_NORM"):
        os.environ.pop(v, None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,2,64,256,768,2048,4096,8192", help="row counts")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the interpreter (CPU)")
    args = ap.parse_args()
    log = lambda msg: print(msg, flush=True)
    t0 = time.perf_counter()
    log(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    d = 256 if args.smoke else D
    rows = [one(log, m, d, args.smoke)
            for m in ([8] if args.smoke else [int(v) for v in args.ms.split(",")])]
    model = model_check(log, args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = common.run_info(device=not args.smoke) | dict(
        kernel="norm_quantize", mode="norm_quant", seconds=time.perf_counter() - t0, rows=rows,
        model=model)
    (out / "bench_norm_quant.json").write_text(json.dumps(record, indent=1))
    keys = ("bf16_norm", "bf16_add") + tuple(
        f"{a}_{b}" for a in ("fp8", "int8") for b in ("norm", "add", "product"))
    print("\n| M | case | XLA ms | kernel ms | vs XLA | TB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        for k in keys:
            print(f"| {r['m']} | {k} | {r[k]['xla_ms']:.4f} | {r[k]['kernel_ms']:.4f} | "
                  f"{r[k]['speedup_vs_xla']:.2f}x | {r[k]['tbps']:.2f} |")
    print(f"{time.perf_counter() - t0:.0f} s")
    if not all(r[k]["ok"] for r in rows for k in keys) or not all(
            v["ok"] for v in model.values()):
        raise SystemExit("the kernel disagreed with its reference, or the model's logits moved")


if __name__ == "__main__":
    main()
