"""Paged decode over float8 K/V pages: the kernel's `fp8_dot` paths and tiles against bf16 pages
and against a copy of the same bytes.

  python -m benchmarks.sweep_fp8kv --out DIR             (~2-3 minutes on an H100)
  python -m benchmarks.sweep_fp8kv --out DIR --smoke     (tiny shapes, interpreter, CPU)

Shapes: Llama-3-8B heads (32 query / 8 kv heads of 128), pages of 16 tokens, at batch 64 /
context 4k, batch 8 / 8k (split-K territory) and batch 768 / contexts of 64-576 tokens
(mean 320; a ShareGPT-like serving step). Per shape, on fresh random inputs: the library's bf16
decode, the library's float8 default, each float8 variant, and an XLA copy that reads and writes
as many bytes in all as the float8 kernel reads (K and V once). Every kernel is first checked
against the jnp reference (on its own pages: the same math) with freed device memory filled
with NaN first. Times are device medians (profiler trace, L2 flushed before each call,
`benchmarks/common.py`). Prints, per variant, ms, the fraction of the copy's speed over the
bytes it reads and the speedup over bf16 pages; writes DIR/sweep_fp8kv.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import common
from pallasite import kernels as K
from pallasite.kernels import reference, tuning

H, KV, D, PAGE = 32, 8, 128, 16
TOL = 2e-2  # the attention benchmarks' tolerance against the reference (bf16 outputs)
SHAPES = [("B=64 ctx 4k", 64, 4096, 4096), ("B=8 ctx 8k", 8, 8192, 8192),
          ("B=768 ctx 64-576", 768, 64, 576)]
SMOKE_SHAPES = [("B=3 ctx 20-60", 3, 20, 60)]


def _v(dot, rows, block_k, stages, warps=4):
    name = f"fp8 {dot} rows={rows} k={block_k} st={stages} w={warps}"
    return name, dict(fp8_dot=dot, block_rows=rows, pages_per_block=block_k // PAGE,
                      num_stages=stages, num_warps=warps)


# rows=1 means the group's G rows (the "fma" path's least); MMA paths take 16 at least.
# The library's float8 default ("decode_fp8" in kernels/tuning.py) runs too, as "fp8 default".
VARIANTS = [
    _v("q", 16, 128, 3),  # the old path at the best of its earlier tiles
    _v("f16", 16, 128, 3), _v("f16", 16, 256, 3),
    _v("f16_swap", 16, 128, 3), _v("f16_swap", 16, 64, 4), _v("f16_swap", 16, 256, 3),
    _v("f16_swap_qk", 16, 128, 3), _v("f16_swap_qk", 16, 64, 4),
    _v("fma", 1, 64, 3), _v("fma", 1, 64, 4), _v("fma", 1, 64, 3, 8),
    _v("fma_rows", 1, 128, 3), _v("fma_rows", 1, 64, 4), _v("fma_rows", 1, 128, 3, 8),
    # shared memory per program: fewer stages or keys let more programs share an SM, for the
    # short contexts of a serving step
    _v("f16", 16, 128, 2), _v("f16", 16, 64, 2), _v("f16", 16, 64, 3), _v("f16", 16, 32, 2),
    _v("f16", 16, 128, 2, 8), _v("f16", 16, 256, 2),
    # q K^T on the float8 tensor cores (q as two e4m3 terms): K's tiles are never converted
    _v("e4m3", 16, 128, 2), _v("e4m3", 16, 128, 3), _v("e4m3", 16, 64, 2), _v("e4m3", 16, 64, 3),
    _v("e4m3", 16, 256, 2),
]


def inputs(key, B, lo, hi):
    """q [B, H, D]; bf16 pages and their float8 form with per-kv-head scales; lengths in
    [lo, hi]; a shuffled page table."""
    pps = -(-hi // PAGE)
    kq, kk, kv, kt, kl = jax.random.split(key, 5)
    q = jax.random.normal(kq, (B, H, D), jnp.bfloat16)
    spread = jnp.linspace(0.5, 2.0, KV)[:, None, None, None]  # heads of unequal size
    kp = (jax.random.normal(kk, (KV, B * pps, PAGE, D)) * spread).astype(jnp.bfloat16)
    vp = (jax.random.normal(kv, (KV, B * pps, PAGE, D)) * spread[::-1]).astype(jnp.bfloat16)
    table = jax.random.permutation(kt, B * pps).reshape(B, pps).astype(jnp.int32)
    lens = jax.random.randint(kl, (B,), lo, hi + 1).astype(jnp.int32)
    pages8, scales = fp8_pages(kp, vp)
    return q, (kp, vp), pages8, scales, lens, table


def fp8_pages(kp, vp):
    """Float8 K/V pages with per-kv-head scales (amax / 448), as the engine stores them (K /
    k_scale, V keys-last: `reference.keys_last`), and their scales as the kernels take them."""
    scales, pages8 = [], []
    for x in (kp, vp):
        s = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 2, 3)) / 448.0
        scales.append(s)
        pages8.append((x.astype(jnp.float32) / s[:, None, None, None]).astype(jnp.float8_e4m3fn))
    return (pages8[0], jnp.swapaxes(pages8[1], 2, 3)), dict(k_scale=scales[0], v_scale=scales[1])


def timed(fn, args, smoke):
    if smoke:
        return common.time_ms(fn, *args, reps=1, inner=1)
    return common.device_ms(fn, *args, reps=10)


def sweep_shape(log, name, B, lo, hi, smoke, only):
    q, (kp, vp), (k8, v8), sc, lens, table = inputs(jax.random.PRNGKey(B * 7 + hi), B, lo, hi)
    keys = int(jnp.sum(lens))
    fp8_bytes = 2 * keys * KV * D
    pallas = dict(impl="pallas", interpret=smoke)
    ref8 = jax.jit(lambda q, k, v, l, t: reference.paged_attention_reference(q, k, v, l, t, **sc))(
        q, k8, v8, lens, table)
    ref16 = jax.jit(reference.paged_attention_reference)(q, kp, vp, lens, table)
    runs = [("bf16 default", (kp, vp), {}, ref16), ("fp8 default", (k8, v8), sc, ref8)]
    # The engine's entry for a decode step (one token per sequence on the ragged axis)
    runs.append(("fp8 engine path", (k8, v8), dict(sc, ragged=True), ref8))
    if not smoke:  # the Mosaic GPU kernel runs on Hopper only (its CPU tests interpret it)
        runs.append(("bf16 mosaic", (kp, vp), dict(backend="mosaic"), ref16))
    runs += [(n, (k8, v8), dict(sc, **kw), ref8) for n, kw in VARIANTS if only in n]
    rows = {}
    starts = jnp.arange(B + 1, dtype=jnp.int32)
    for vname, (k, v), kw, ref in runs:
        if kw.pop("ragged", False):
            fn = jax.jit(lambda q, k, v, l, t, kw=kw: K.ragged_paged_attention(
                q, k, v, starts, l, t, **pallas, **kw))
        else:
            fn = jax.jit(lambda q, k, v, l, t, kw=kw: K.paged_attention(q, k, v, l, t,
                                                                        **pallas, **kw))
        try:
            if not smoke:
                common.poison()
            err = common.rel_err(fn(q, k, v, lens, table), ref)
        except Exception as e:  # e.g. tiles past the shared memory or registers
            log(f"  {vname}: does not run ({str(e).splitlines()[0][:120]})")
            continue
        ms = timed(fn, (q, k, v, lens, table), smoke)
        rows[vname] = dict(ms=ms, rel_err=err, ok=bool(err <= TOL),
                           kv_bytes=fp8_bytes * k.dtype.itemsize, options=kw and {
                               a: b for a, b in kw.items() if a not in sc})
        if vname.endswith("default"):  # the tiles the library picked
            rows[vname]["options"] = tuning.params(
                "decode_fp8" if k.dtype == jnp.float8_e4m3fn else "decode", PAGE)
        log(f"  {vname}: {ms:.4f} ms, rel err {err:.1e}{'' if err <= TOL else ' FAILED'}")
    # The copy: reads fp8_bytes / 2 and writes as many, in bf16 elements.
    x = jnp.ones((fp8_bytes // 4,), jnp.bfloat16)
    copy_ms = timed(lambda x: x + 1, (x,), smoke)
    del x
    base = rows["bf16 default"]["ms"]
    for r in rows.values():
        r["frac_of_copy_bw"] = copy_ms * r["kv_bytes"] / fp8_bytes / r["ms"]
        r["tbps"] = r["kv_bytes"] / (r["ms"] / 1e3) / 1e12
        r["speedup_vs_bf16"] = base / r["ms"]
    log(f"  copy of {fp8_bytes / 1e6:.0f} MB (read + written): {copy_ms:.4f} ms")
    fp8 = {n: r for n, r in rows.items() if n.startswith("fp8") and r["ok"]}
    best = min(fp8, key=lambda n: fp8[n]["ms"]) if fp8 else None
    return dict(shape=name, batch=B, context_min=lo, context_max=hi, keys=keys, heads=H,
                kv_heads=KV, head_dim=D, page_size=PAGE, copy_ms=copy_ms,
                copy_tbps=fp8_bytes / (copy_ms / 1e3) / 1e12, variants=rows, best_fp8=best)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="time only the float8 variants whose name "
                    "holds this text (the two defaults always run)")
    ap.add_argument("--shapes", default="", help="comma-separated batch sizes of SHAPES to run "
                    "(default: all)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in Pallas's interpreter: checks the script, not the GPU")
    args = ap.parse_args()
    log = lambda msg: print(msg, flush=True)
    t0 = time.perf_counter()
    log(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    shapes = []
    pick = {int(b) for b in args.shapes.split(",") if b}
    for name, B, lo, hi in SMOKE_SHAPES if args.smoke else SHAPES:
        if pick and B not in pick and not args.smoke:
            continue
        log(name)
        shapes.append(sweep_shape(log, name, B, lo, hi, args.smoke, args.only))
    head = common.run_info(device=not args.smoke) | dict(seconds=time.perf_counter() - t0)
    records = [head | dict(kernel="paged_attention", mode="decode_kernel",
                           kv_dtype="float8_e4m3fn", scales="per KV head",
                           frac_of_copy_bw=s["variants"].get("fp8 default", {}).get(
                               "frac_of_copy_bw"),
                           speedup_vs_bf16=s["variants"].get("fp8 default", {}).get(
                               "speedup_vs_bf16"), **s) for s in shapes]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_fp8kv.json").write_text(json.dumps(records, indent=1))
    for s in shapes:
        print(f"\n| {s['shape']} | ms | of copy | vs bf16 | rel err |\n|---|---|---|---|---|")
        for n, r in s["variants"].items():
            print(f"| {n} | {r['ms']:.4f} | {100 * r['frac_of_copy_bw']:.0f}% | "
                  f"{r['speedup_vs_bf16']:.2f}x | {r['rel_err']:.1e}"
                  f"{'' if r['ok'] else ' FAILED'} |")
        print(f"copy {s['copy_ms']:.4f} ms ({s['copy_tbps']:.2f} TB/s); best float8: "
              f"{s['best_fp8']} (target >= 85% of copy at B=64 ctx 4k)")
    print(f"{time.perf_counter() - t0:.0f} s")
    if not all(r["ok"] for s in shapes for r in s["variants"].values()):
        raise SystemExit("a kernel disagreed with the reference")


if __name__ == "__main__":
    main()
