"""W8A8 (FP8 x FP8, per-token activation scales) at the Llama-3-8B layer shapes: XLA's FP8 dot
with the weight stored [K, N] (as now) or [N, K] (both operands along K, as cuBLASLt's FP8 GEMM
reads them), with and without fast accumulation and with and without the activations'
quantization counted; the Pallas Triton kernel (`kernels/w8a8_matmul.py`) in both layouts; and
the Mosaic GPU kernel (`kernels/w8a8_mgpu.py`, [N, K] only); all against the bf16 product timed
in the same trace.

    python -m benchmarks.bench_w8a8 --out DIR          # H100: about 3 minutes
    python -m benchmarks.bench_w8a8 --out DIR --tiny   # CPU, interpret mode: about a minute

Shapes qkv 4096x6144, o 4096x4096, gate_up 4096x28672, down 14336x4096 at M = 2048, 8192,
512, 128, case by case in that order (a --time-limit cut keeps the prefill sizes), tiers 1
(bf16, the quantization pass, XLA, the Triton kernel) and "mosaic" (the Mosaic GPU kernel, its
own tier so that a kernel Mosaic does not lower stops nothing else); then tier 2, more Triton
tiles, over the cases again while time is left. Tier "out" asks what the product's float32
output costs: XLA's FP8 dot writing bf16 (per-token, or one dynamic activation scale for the
whole tensor), the scales applied after; and the INT8 W8A8 product (int8 weights per channel,
INT32 out, or asked for float32 out). `--shapes` also takes the model's unfused
projections: wq 4096x4096, kv 4096x1024, gate 4096x14336.

Every variant is first run on fresh random inputs (rows of very different sizes) with freed
device memory poisoned (NaN), and its relative error against `quant_reference.w8a8_reference`
(the float32 product of the same FP8 inputs, rounded to bf16) recorded; over 1e-3 is marked
failed (still timed: the fast-accumulation variants are expected to fail). Times: the median
over --reps calls of the GPU time of the kernels one call launches, read from one profiler
trace per case and tier with the L2 flushed before every call (`benchmarks/common.py`); the
kernels' names are recorded, which shows whether XLA transposes the weight or scales the
product in a kernel of its own. Writes DIR/bench_w8a8.json and DIR/bench_w8a8.md and prints a
table (us, TFLOP/s, ratio to bf16, error, kernels) per case and the best XLA, Triton and Mosaic
GPU variant per case (activation quantization included).
"""

from __future__ import annotations

import argparse
import json
import os
import pprint
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from pallasite.kernels import quant_reference as qr
from pallasite.kernels import w8a8_matmul as wm
from pallasite.kernels import w8a8_mgpu as wmg

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
EXTRA_SHAPES = {"wq": (4096, 4096), "kv": (4096, 1024), "gate": (4096, 14336)}
MS = (2048, 8192, 512, 128)
TINY_SHAPES, TINY_MS = {"tiny": (256, 512)}, (64, 128)
LIMIT = 1e-3
# Pallas tiles (block_m, block_n, block_k, num_warps, num_stages); tier 1 runs the first.
# The defaults first; Triton's FP8 partial accumulator doubles the registers an output tile
# takes (w8a8_matmul.py), so the larger tiles may spill.
TILES = [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4),
         (128, 128, 128, 4, 4), (256, 128, 128, 8, 3), (128, 128, 64, 8, 5)]
TINY_TILES = [(64, 128, 128, 4, 1), (64, 256, 128, 4, 1)]
# Mosaic GPU tiles (block_m, block_n, block_k, num_stages, promote), "nk" weights only.
MOSAIC = [(64, 128, 128, 3, True), (64, 128, 128, 4, True), (128, 128, 128, 3, True),
          (64, 128, 128, 3, False)]
TINY_MOSAIC = [(64, 128, 128, 2, True)]


def tile_kw(t):
    return dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), t))


# -- variants: name -> (fn, which inputs: "x" the bf16 activations, "xq" already quantized) ------
PARAMS = {}  # variant name -> the kernel tiles it runs


def variants(tier, tiny):
    """name -> (fn, which inputs it takes: "bf16", "quantize", a layout, or a layout + "_xq"
    for already quantized activations)."""
    tiles = TINY_TILES if tiny else TILES
    hi = dict(interpret=tiny)
    if tier == "mosaic":  # its own tier: a kernel Mosaic does not lower stops nothing else
        v = {}
        for i, t in enumerate(TINY_MOSAIC if tiny else MOSAIC):
            kw = dict(zip(("block_m", "block_n", "block_k", "num_stages", "promote"), t))
            name = "mosaic_nk_" + "x".join(map(str, t[:4])) + ("" if t[4] else "_fast")
            PARAMS[name] = PARAMS[name + "_dot"] = kw
            v[name] = (lambda x, q, s, kw=kw: wmg.w8a8_matmul(x, q, s, **hi, **kw), "nk")
            if i == 0:
                v[name + "_dot"] = (lambda xq, xs, q, s, kw=kw: wmg.w8a8_matmul_quantized(
                    xq, xs, q, s, **hi, **kw), "nk_xq")
        return v
    if tier == "1":
        v = {"bf16": (lambda x, w: x @ w, "bf16"),
             "quantize": (lambda x: qr.quantize_rows(x), "quantize")}
        for layout in ("kn", "nk"):
            for fast in (False, True):
                tag = f"xla_{layout}" + ("_fast" if fast else "")
                v[tag] = (lambda x, q, s, lo=layout, f=fast: qr.w8a8_matmul(
                    x, q, s, layout=lo, fast=f), layout)
                if not fast:  # the dot alone (its activations quantized beforehand)
                    v[tag + "_dot"] = (lambda xq, xs, q, s, lo=layout: qr.w8a8_dot(
                        xq, xs, q, s, layout=lo).astype(jnp.bfloat16), layout + "_xq")
            kw = PARAMS[f"pallas_{layout}"] = PARAMS[f"pallas_{layout}_dot"] = tile_kw(tiles[0])
            v[f"pallas_{layout}"] = (lambda x, q, s, lo=layout, kw=kw: wm.w8a8_matmul(
                x, q, s, layout=lo, **hi, **kw), layout)
            if layout == "nk":
                v["pallas_nk_dot"] = (lambda xq, xs, q, s, kw=kw: wm.w8a8_matmul_quantized(
                    xq, xs, q, s, layout="nk", **hi, **kw), "nk_xq")
        return v
    if tier == "out":
        return {"xla_nk": (lambda x, q, s: qr.w8a8_matmul(x, q, s, layout="nk"), "nk"),
                "xla_nk_bf16out": (lambda x, q, s: _fp8_out(x, q, s, qr.quantize_rows), "nk"),
                "xla_nk_tensor_f32out": (lambda x, q, s: _fp8_out(x, q, s, _quantize_tensor,
                                                                  jnp.float32), "nk"),
                "xla_nk_tensor": (lambda x, q, s: _fp8_out(x, q, s, _quantize_tensor), "nk"),
                "int8_nk": (lambda x, q, s: qr.w8a8_int8_matmul(x, q, s, layout="nk"), "int8"),
                "int8_nk_f32out": (_int8_f32, "int8")}
    v = {}
    for t in tiles[1:]:
        for layout in ("nk", "kn"):
            name = f"pallas_{layout}_" + "x".join(map(str, t))
            PARAMS[name] = tile_kw(t)
            v[name] = (lambda x, q, s, lo=layout, kw=tile_kw(t): wm.w8a8_matmul(
                x, q, s, layout=lo, **hi, **kw), layout)
    return v


def _quantize_tensor(x):
    """One dynamic FP8 scale for the whole activation tensor."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    s = jnp.where(amax > 0, amax / qr.FP8_MAX, 1.0)
    return (x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn), s


def _fp8_out(x, q, scale, quantize, out=jnp.bfloat16):
    """The FP8 dot writing `out`, the scales applied after (in float32, rounded to bf16)."""
    xq, xs = quantize(x)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=out)
    return (y.astype(jnp.float32) * scale * xs).astype(jnp.bfloat16)


def _int8_f32(x, q, scale):
    xq, xs = qr.quantize_rows_int8(x)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale * xs).astype(jnp.bfloat16)


class Weights:
    """One shape's FP8 weight in both layouts (per-channel scales), its INT8 form ([N, K]) and
    its bf16 original."""

    def __init__(self, key, k, n):
        w = jax.random.normal(key, (k, n), jnp.float32)
        self.scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / qr.FP8_MAX
        self.kn = (w / self.scale).astype(jnp.float8_e4m3fn)
        self.nk = jnp.asarray(self.kn.T, copy=True)  # stored transposed, not a view
        self.scale8 = jnp.max(jnp.abs(w), axis=0, keepdims=True) / qr.INT8_MAX
        self.i8 = jnp.asarray(jnp.round(w / self.scale8).T.astype(jnp.int8), copy=True)
        self.bf16 = w.astype(jnp.bfloat16)
        del w


def inputs(kind, x, wts):
    if kind == "bf16":
        return (x, wts.bf16)
    if kind == "quantize":
        return (x,)
    if kind == "int8":
        return (x, wts.i8, wts.scale8)
    layout = kind.split("_")[0]
    q = wts.nk if layout == "nk" else wts.kn
    if kind.endswith("_xq"):
        return (*qr.quantize_rows(x), q, wts.scale)
    return (x, q, wts.scale)


# -- timing ------------------------------------------------------------------------------------
def poison():
    if jax.default_backend() == "gpu":
        common.poison()


# -- one case ------------------------------------------------------------------------------------
def run_case(name, k, n, m, wts, tier, args):
    key = jax.random.key(m * 31 + k + n + len(tier))
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    xc = (jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32)
          * jax.random.uniform(jax.random.fold_in(key, 2), (m, 1), jnp.float32, 0.1, 10)
          ).astype(jnp.bfloat16)
    ref = qr.w8a8_reference(xc, wts.kn, wts.scale)
    # the variant whose GEMM writes a bf16 product, against the same rounding (on a GPU;
    # XLA:CPU folds the rounding back into a float32 dot)
    ref_bf16 = qr.w8a8_reference(xc, wts.kn, wts.scale, product=jnp.bfloat16
                                 if jax.default_backend() == "gpu" else jnp.float32)
    bf16_product = lambda v: v == "xla_nk_bf16out" or v in ("xla_kn", "xla_nk")
    records, timed = [], []
    for vname, (fn, kind) in variants(tier, args.tiny).items():
        fn = jax.jit(fn)
        rec = dict(shape=name, k=k, n=n, m=m, variant=vname, tier=tier, limit=LIMIT,
                   quantize_counted=kind in ("kn", "nk", "int8"), layout=kind.split("_")[0],
                   params=PARAMS.get(vname))
        try:
            poison()
            out = jax.block_until_ready(fn(*inputs(kind, xc, wts)))
            if kind == "quantize":  # the quantized rows against quantize_rows' own float32 math
                xq, xs = out
                rec["rel_err"] = common.rel_err(xq.astype(jnp.float32) * xs,
                                                xc.astype(jnp.float32))
            elif kind == "int8":  # against the same INT8 quantization in float32
                rec["rel_err"] = common.rel_err(out, qr.w8a8_int8_reference(
                    xc, wts.i8, wts.scale8, layout="nk"))
            elif kind == "bf16":  # against the float32 product (bf16 output rounding only)
                want = jnp.dot(xc.astype(jnp.float32), wts.bf16.astype(jnp.float32),
                               precision=jax.lax.Precision.HIGHEST)
                rec["rel_err"] = common.rel_err(out, want)
            else:
                rec["rel_err"] = common.rel_err(out, ref_bf16 if bf16_product(vname) else ref)
            del out
            rec["passed"] = kind in ("quantize", "bf16") or rec["rel_err"] <= LIMIT
            timed.append((rec, fn, inputs(kind, x, wts)))
        except Exception as e:  # a variant that does not compile is a finding, not a stop
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  {name} M={m} {vname}: {rec['error']}", flush=True)
        records.append(rec)
    if tier != "1":  # the baseline again, in this trace
        timed.append((dict(variant="bf16"), jax.jit(lambda x, w: x @ w), (x, wts.bf16)))
    try:
        times = common.device_times([(fn, a) for _, fn, a in timed], args.reps)
    except Exception as e:
        for rec, _, _ in timed:
            rec["error"] = f"timing: {type(e).__name__}: {str(e)[:300]}"
        print(f"  {name} M={m}: timing failed: {e}", flush=True)
        return records
    bf16_ms = next(t for (r, _, _), (t, _) in zip(timed, times) if r["variant"] == "bf16")
    flops = 2 * m * k * n
    for (rec, _, _), (ms, names) in zip(timed, times):
        rec.update(us=1e3 * ms, bf16_us=1e3 * bf16_ms, tflops=flops / (ms * 1e-3) / 1e12,
                   speedup_vs_bf16=bf16_ms / ms, kernels=names)
    return records


# -- report --------------------------------------------------------------------------------------
def short(names):
    return ", ".join(n[:40] for n in names[:4]) + (" ..." if len(names) > 4 else "")


def report(records):
    lines = ["| shape | M | variant | us | TFLOP/s | vs bf16 | rel err | kernels |",
             "|---|---|---|---|---|---|---|---|"]
    best = {}
    for r in records:
        if r.get("us") is None:
            note = r.get("error", "not timed")[:80]
            lines.append(f"| {r['shape']} | {r['m']} | {r['variant']} | | | | | {note} |")
            continue
        err = r.get("rel_err", float("nan"))
        flag = "" if r.get("passed", True) else " FAIL"
        lines.append(f"| {r['shape']} | {r['m']} | {r['variant']} | {r['us']:.1f} | "
                     f"{r['tflops']:.0f} | {r['speedup_vs_bf16']:.2f} | {err:.1e}{flag} | "
                     f"{short(r['kernels'])} |")
        family = r["variant"].split("_")[0]
        if r.get("quantize_counted") and r.get("passed"):
            key = (r["shape"], r["m"], family)
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    lines += ["", "Best checked W8A8 per case, activation quantization included:",
              "| shape | M | bf16 us | best XLA | us | vs bf16 | best Triton | us | vs bf16 | "
              "best Mosaic GPU | us | vs bf16 |", "|---" * 12 + "|"]
    for shape, m in dict.fromkeys((k[0], k[1]) for k in best):
        got = [best.get((shape, m, f)) for f in ("xla", "pallas", "mosaic")]
        cell = lambda r: (f"{r['variant']} | {r['us']:.1f} | {r['speedup_vs_bf16']:.2f}"
                          if r else "- | | ")
        bf16 = next(r for r in got if r)["bf16_us"]
        lines.append(f"| {shape} | {m} | {bf16:.1f} | " + " | ".join(map(cell, got)) + " |")
    return "\n".join(lines) + "\n\n" + tuning_entries(records)


def tuning_entries(records):
    """The fastest checked Triton tiles on [K, N] weights (the model's layout) per shape and M,
    as `kernels/tuning.py` QUANT_MATMUL["w8a8"] entries."""
    best = {}
    for r in records:
        if (r.get("us") is None or not r.get("passed") or r["layout"] != "kn"
                or not r["variant"].startswith("pallas_")):
            continue
        key = (r["k"], r["n"], r["m"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    entries = {}
    for (k, n, m), r in sorted(best.items()):
        entries.setdefault((k, n), []).append((m, r["params"]))
    return ('kernels/tuning.py QUANT_MATMUL["w8a8"] (the first M that covers a call wins):\n'
            + pprint.pformat(entries, width=100, sort_dicts=False))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per variant (median)")
    p.add_argument("--time-limit", type=float, default=165.0,
                   help="seconds; cases past it are skipped and the results written")
    p.add_argument("--tiers", default="1,mosaic,2",
                   help="1: XLA and the Triton kernel's first tiles; mosaic: the Mosaic GPU "
                        "kernel; 2: more Triton tiles; out: the product's output dtype and "
                        "INT8")
    p.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    p.add_argument("--ms", default=None, help="comma-separated M values")
    args = p.parse_args(argv)
    t0 = time.time()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {s: (SHAPES | EXTRA_SHAPES | TINY_SHAPES)[s] for s in args.shapes.split(",")}
    ms = [int(m) for m in args.ms.split(",")] if args.ms else (TINY_MS if args.tiny else MS)
    if args.tiny:
        args.reps = min(args.reps, 2)
    head = common.run_info() | dict(tiny=args.tiny, reps=args.reps)
    print(f"{head['gpu']}, jax {jax.__version__}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, weights = [], {}

    def write():
        (out / "bench_w8a8.json").write_text(json.dumps(
            dict(head=head, elapsed_s=round(time.time() - t0, 1), records=records), indent=1,
            default=str))

    try:
        tiers = args.tiers.split(",")
        # case by case for the first tiers (all of them for the prefill sizes first), then
        # the tile sweep over the cases again
        order = [(m, name, t) for m in ms for name in shapes for t in tiers if t != "2"]
        order += [(m, name, "2") for m in ms for name in shapes if "2" in tiers]
        for m, name, tier in order:
            if time.time() - t0 > args.time_limit:
                print(f"  time limit: {name} M={m} tier {tier} and later not run", flush=True)
                break
            k, n = shapes[name]
            if name not in weights:
                weights[name] = Weights(jax.random.key(k + n), k, n)
            recs = run_case(name, k, n, m, weights[name], tier, args)
            records.extend(head | r for r in recs)
            for r in recs:
                if r.get("us") is not None:
                    print(f"  {name:8s} M={m:5d} {r['variant']:26s} {r['us']:9.1f} us "
                          f"{r['tflops']:6.0f} TFLOP/s x{r['speedup_vs_bf16']:.2f} "
                          f"err {r.get('rel_err', float('nan')):.1e}", flush=True)
            write()
    finally:
        write()
        table = report(records)
        (out / "bench_w8a8.md").write_text(table + "\n")
        print(table)
        print(f"{time.time() - t0:.0f} s; wrote {out / 'bench_w8a8.json'}")


if __name__ == "__main__":
    main()
