"""Variants of the quantized matmul kernels at Llama-3-8B layer shapes, in one run: first W8A8
(XLA's FP8 dot, per-token scales) at M = 2048 with and without cuBLASLt's fast accumulation (and
with it over 512-row chunks of K only), against bf16 and W8A16; then the FP8 W8A16 kernel
(`kernels/w8a16_matmul.py`) and the INT4 W4A16 kernel (`kernels/w4a16_matmul.py`, group 128) at
M = 1, 4, 16, each variant beside XLA's bf16 product and a device copy of the same weight bytes
(the copy ceiling).

    python -m benchmarks.sweep_quant --out DIR                   # H100: about 4.5 minutes
    python -m benchmarks.sweep_quant --out DIR --tiny            # CPU, interpret mode: < 1 min

Every variant is first checked against its jnp reference on fresh random inputs with freed
device memory poisoned (NaN), so an unwritten output shows; a variant that fails to compile or
to match (relative error > 1e-3) is recorded and not timed. Times are the median over --reps
calls of the GPU time of the kernels one call launches (one profiler trace per case, the L2
flushed before every call; `benchmarks/common.py`), the split-K reduction included. Variants
run in tiers: the first tier over every case, then the second (tier 3: the INT4 kernel's
per-group forms beside its best per-slab ones); --time-limit stops between
variants and writes what it has. Writes DIR/sweep_quant.json (every record) and prints the best
variant per kernel, shape and M (TB/s on the weight and scale bytes, fraction of the copy
ceiling, speed-up over bf16) and the `kernels/tuning.py` QUANT_MATMUL entries they make.
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
from jax.experimental import pallas as pl

from benchmarks import common
from pallasite.kernels import quant_reference as qr
from pallasite.kernels import w4a16_matmul as im
from pallasite.kernels import w8a16_matmul as wm

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
# the model's own products where q/k/v and gate/up are separate weights
EXTRA_SHAPES = {"kv": (4096, 1024), "gate": (4096, 14336)}
TINY_SHAPES = {"tiny": (512, 256)}
MS = (1, 2, 4, 16)
PREFILL_M = 2048
GROUP = 128
LIMIT = 1e-3  # relative error against the same-math reference
# the dequantize-then-XLA product rounds the weights to bf16 first (about 2.6e-3 at these shapes)
LIMITS = {"int4_xla": 1e-2}


# -- variants --------------------------------------------------------------------------------------
def fp8_split(k, n, block_n, block_k, target):
    """Largest power-of-two K split that keeps (N / block_n) * split <= target programs."""
    split = 1
    while ((n // block_n) * split * 2 <= target and k % (split * 2 * block_k) == 0
           and k // (split * 2) >= block_k):
        split *= 2
    return split


def fp8_variants(m, k, n, tier):
    """(name, kwargs of w8a16_matmul) for this tier."""
    def v(bn, bk, target, warps, stages, **extra):
        bn = min(bn, n)
        bk = min(bk, k)
        kw = dict(block_m=16, block_n=bn, block_k=bk, split_k=fp8_split(k, n, bn, bk, target),
                  num_warps=warps, num_stages=stages, **extra)
        if extra.get("reduce", "dot") != "dot":
            kw["block_m"] = 1
        return kw
    if tier == 3:  # the INT4 kernel's tier only
        return []
    if tier == 1:
        out = [wm.blocks_for(m, k, n) | dict(num_warps=4, num_stages=4),
               v(128, 256, 264, 4, 4), v(128, 256, 264, 4, 4, swap=True, dot_dtype="float16"),
               v(128, 512, 264, 4, 3, swap=True)]
        # Triton does not pipeline loads that feed no dot: many small programs hide latency
        out += [v(64, 128, 1056, 4, 2, reduce="sum"), v(64, 128, 1056, 4, 2, reduce="acc"),
                v(128, 64, 528, 4, 2, reduce="acc"), v(256, 32, 264, 4, 3, reduce="acc"),
                v(128, 128, 528, 8, 2, reduce="acc"), v(256, 64, 528, 8, 2, reduce="acc"),
                v(32, 128, 2112, 2, 2, reduce="acc")] if m == 1 else []
    else:
        out = [v(128, 512, 264, 4, 3), v(256, 256, 264, 8, 3), v(64, 512, 528, 4, 3),
               v(128, 256, 264, 4, 4, dot_dtype="float16"),
               v(256, 256, 264, 8, 3, swap=True, dot_dtype="float16"),
               v(64, 256, 528, 4, 4, swap=True, dot_dtype="float16"),
               v(128, 256, 528, 4, 4, swap=True)]
        out += [v(128, 256, 264, 4, 4, reduce="sum"), v(64, 256, 528, 4, 4, reduce="sum"),
                v(32, 128, 2112, 2, 2, reduce="sum")] if m == 1 else []
    return out


def fp8_nk_variants(m, k, n, tier):
    """kwargs of w8a16_matmul on weights stored [N, K] (rows of block_k contiguous bytes)."""
    def v(bn, bk, target, warps, stages, **extra):
        bn, bk = min(bn, n), min(bk, k)
        kw = dict(block_m=m if extra.get("reduce", "dot") != "dot" else 16, block_n=bn,
                  block_k=bk, split_k=fp8_split(k, n, bn, bk, target), num_warps=warps,
                  num_stages=stages, layout="nk", **extra)
        return kw
    if tier != 1:
        return []
    if m == 1:
        return [v(32, 256, 1056, 4, 2, reduce="acc"), v(16, 512, 1056, 4, 2, reduce="acc"),
                v(64, 256, 528, 8, 2, reduce="acc"), v(32, 512, 528, 8, 2, reduce="acc"),
                v(16, 256, 2112, 4, 2, reduce="acc"), v(32, 256, 1056, 4, 3, reduce="sum"),
                v(64, 256, 264, 4, 4, swap=True)]
    rows = [v(32, 256, 1056, 4, 3, reduce="sum"), v(64, 256, 528, 8, 2, reduce="sum"),
            v(32, 128, 1056, 4, 3, reduce="sum"), v(16, 256, 2112, 4, 3, reduce="sum"),
            v(16, 256, 2112, 4, 2, reduce="acc"), v(32, 128, 1056, 4, 2, reduce="acc")
            ] if 1 < m <= 8 else []
    return rows + [v(64, 256, 528, 4, 4, swap=True), v(128, 256, 264, 4, 4, swap=True),
            v(64, 512, 528, 4, 3, swap=True), v(128, 128, 528, 4, 4, swap=True),
            v(64, 256, 528, 4, 4, swap=True, dot_dtype="float16")]


def int4_variants(m, k, n, tier):
    """kwargs of im.int_matmul (block_n and num_splits always named, so no table applies)."""
    num_tiles = im.padded_k(k, 4) // im.tile_rows(4)

    def v(bn, target, warps, stages, unpack="magic", reduce="dot", swap=False, bm=None):
        bn = min(bn, n)
        named = bm is not None and bm <= pl.next_power_of_2(m)
        bm = bm if named else (im.block_m_for(m) if reduce in im.MMA_REDUCES
                               else pl.next_power_of_2(m))
        splits = im.splits_for(-(-m // bm) * bm, n, num_tiles, bm, bn, target)
        return dict(block_n=bn, num_splits=splits, num_warps=warps, num_stages=stages,
                    unpack=unpack, reduce=reduce, swap=swap, **({"block_m": bm} if named else {}))
    if tier == 3:  # a group's slabs summed first, beside the best per-slab forms before
        if m == 1:
            return [v(64, 1056, 4, 3, reduce="acc"), v(32, 2112, 4, 3, reduce="acc")] + [
                v(bn, target, warps, 3, reduce="acc_group") for bn, target, warps in
                ((64, 1056, 4), (32, 2112, 4), (128, 528, 4), (64, 528, 4), (64, 1056, 8),
                 (32, 1056, 2))]
        if m <= 8:
            return [v(64, 1056, 4, 3, reduce="acc"), v(64, 1056, 4, 3, reduce="acc_group"),
                    v(32, 2112, 4, 3, reduce="acc_group"), v(128, 528, 4, 3, reduce="acc_group"),
                    v(128, 264, 4, 3), v(128, 264, 4, 3, reduce="dot_group"),
                    v(128, 264, 4, 3, reduce="dot_group", swap=True)]
        out = [v(128, 264, 4, 3), v(128, 264, 4, 3, unpack="convert")] + [
            v(bn, target, warps, stages, reduce="dot_group", swap=swap, unpack=unpack)
            for bn, target, warps, stages, swap, unpack in (
                (128, 264, 4, 3, False, "magic"), (128, 264, 4, 3, True, "magic"),
                (64, 528, 4, 3, False, "magic"), (256, 264, 8, 3, False, "magic"),
                (128, 264, 4, 4, False, "magic"), (128, 264, 4, 3, False, "convert"))]
        if m >= 32:  # taller row blocks: each unpacked slab feeds more rows
            out += [v(bn, 264, warps, stages, reduce="dot_group", bm=bm)
                    for bm, bn, warps, stages in ((32, 128, 4, 3), (128, 128, 8, 3),
                                                  (128, 64, 4, 3), (128, 256, 8, 3),
                                                  (256, 128, 8, 3), (128, 128, 8, 4))]
        return out
    if tier == 1:
        out = [v(128, 264, 4, 3, unpack="convert"), v(128, 264, 4, 3),
               v(128, 264, 4, 3, swap=True), v(64, 528, 4, 3)]
        out += [v(64, 1056, 4, 3, reduce="sum"), v(64, 1056, 4, 3, reduce="acc"),
                v(128, 528, 4, 3, reduce="acc"), v(256, 264, 8, 3, reduce="acc"),
                v(64, 528, 4, 2, reduce="acc"), v(32, 2112, 4, 3, reduce="acc"),
                v(32, 1056, 2, 3, reduce="acc")] if m == 1 else [
            v(64, 1056, 4, 3, reduce="acc"), v(32, 2112, 4, 3, reduce="acc"),
            v(64, 1056, 4, 3, reduce="sum")] if m <= 8 else []
    else:
        out = [v(256, 264, 8, 3), v(256, 264, 8, 3, swap=True), v(128, 528, 4, 4),
               v(64, 528, 4, 3, swap=True), v(128, 264, 8, 2), v(64, 528, 4, 3, unpack="convert"),
               v(32, 1056, 4, 3)]
        out += [v(128, 264, 4, 3, reduce="sum"), v(64, 528, 4, 3, reduce="sum"),
                v(32, 2112, 2, 3, reduce="sum")] if m == 1 else []
    return out


# -- timing ----------------------------------------------------------------------------------------
def device_times(calls, reps):
    """Median ms per call of each (fn, args) (`common.device_times`)."""
    return [ms for ms, _ in common.device_times(calls, reps)]


def poison():
    if jax.default_backend() == "gpu":
        common.poison()


def check(fn, args, ref):
    """Relative error of a fresh call (memory poisoned first), or the exception's text."""
    try:
        poison()
        return common.rel_err(jax.block_until_ready(fn(*args)), ref), None
    except Exception as e:  # a variant Triton or Mosaic does not lower is a finding, not a stop
        return None, f"{type(e).__name__}: {str(e)[:300]}"


# -- one case --------------------------------------------------------------------------------------
class Case:
    """Weights of one shape: FP8 per channel, INT4 g128 symmetric, bf16, and raw bytes to copy."""

    def __init__(self, key, k, n):
        kq, ki = jax.random.split(key)
        w = jax.random.normal(kq, (k, n), jnp.float32)
        self.scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / qr.FP8_MAX
        self.q = (w / self.scale).astype(jnp.float8_e4m3fn)
        self.q_nk = jnp.asarray(self.q.T, copy=True)  # stored transposed, not a view
        self.w = w.astype(jnp.bfloat16)
        del w
        rng = np.random.default_rng(k + n)
        codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
        scale4 = rng.uniform(0.5, 1.5, (k // GROUP, n)).astype(np.float32) / 64
        words, s4, _, _ = im.pack_weight(codes, scale4, None, bits=4, group_size=GROUP)
        self.words, self.s4 = jnp.asarray(words), jnp.asarray(s4)
        self.fp8_bytes = k * n + 4 * n
        self.int4_bytes = words.nbytes + s4.nbytes
        self.copy8 = jnp.zeros((self.fp8_bytes,), jnp.uint8)
        self.copy4 = jnp.zeros((self.int4_bytes,), jnp.uint8)


def fp8_fn(kw, interpret):
    return jax.jit(lambda x, q, s: wm.w8a16_matmul(x, q, s, interpret=interpret, **kw))


def int4_fn(kw, interpret):
    return jax.jit(lambda x, w, s: im.int_matmul(x, w, s, bits=4, group_size=GROUP,
                                                 interpret=interpret, **kw))


def run_case(name, k, n, m, case, tier, args, deadline, baseline):
    """Records of every variant of this tier at (shape, M); `baseline` holds this case's bf16
    and copy times (filled by tier 1)."""
    interpret = args.tiny
    key = jax.random.key(hash((k, n, m)) % 2**31)
    kx, kc = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)       # timed
    xc = jax.random.normal(kc, (m, k), jnp.bfloat16)      # checked
    refs = dict(fp8=qr.w8a16_reference(xc, case.q, case.scale),
                int4=im.int_matmul_reference(xc, case.words, case.s4, bits=4, group_size=GROUP))
    jobs = [("fp8", kw, fp8_fn(kw, interpret), (case.q, case.scale))
            for kw in fp8_variants(m, k, n, tier)]
    jobs += [("fp8_nk", kw, fp8_fn(kw, interpret), (case.q_nk, case.scale))
             for kw in fp8_nk_variants(m, k, n, tier)]
    refs["fp8_nk"] = refs["fp8"]
    if tier == 1 and not args.tiny:  # XLA's FP8 dot (cuBLASLt) on [N, K] at decode sizes too
        refs["w8a8_nk"] = qr.w8a8_reference(xc, case.q, case.scale, product=jnp.bfloat16)
        jobs.append(("w8a8_nk", dict(layout="nk"), jax.jit(
            lambda x, q, s: qr.w8a8_matmul(x, q, s, layout="nk")), (case.q_nk, case.scale)))
    jobs += [("int4", kw, int4_fn(kw, interpret), (case.words, case.s4))
             for kw in int4_variants(m, k, n, tier)]
    if tier == 3 and m >= 16:  # what the library does past INT_MATMUL_MAX_ROWS rows
        refs["int4_xla"] = refs["int4"]
        jobs.append(("int4_xla", dict(dequantize="xla"), jax.jit(
            lambda x, w, s: x @ im.dequantize(w, s, None, bits=4, group_size=GROUP).astype(
                x.dtype)), (case.words, case.s4)))
    if args.tiny:  # a few of each kind, so that every code path runs once in interpret mode
        keep = lambda kern, n: [j for j in jobs if j[0] == kern][:n] + [
            j for j in jobs if j[0] == kern and j[1].get("reduce") == "sum"][:1] + [
            j for j in jobs if j[0] == kern and j[1].get("reduce") == "acc"][:1] + [
            j for j in jobs if j[0] == kern and j[1].get("reduce", "").endswith("group")][:2]
        jobs = (keep("fp8", 2) + keep("fp8_nk", 1) + keep("int4", 2) if tier == 1
                else keep("int4", 0) if tier == 3 else keep("fp8", 2)[1:2])
    jobs = [j for j in jobs if j[0] in args.kernels.split(",")]
    records, timed = [], []
    for kernel, kw, fn, wargs in jobs:
        if time.time() > deadline:
            break
        t0 = time.time()
        err, fail = check(fn, (xc, *wargs), refs[kernel])
        rec = dict(kernel=kernel, shape=name, k=k, n=n, m=m, tier=tier, params=kw,
                   rel_err=err, check_s=round(time.time() - t0, 2))
        limit = LIMITS.get(kernel, LIMIT)
        if fail or not (err is not None and err <= limit):
            rec["error"] = fail or f"relative error {err} > {limit}"
            print(f"  {kernel} {name} M={m} {kw}: FAILED {rec['error'][:160]}", flush=True)
        else:
            timed.append((rec, fn, (x, *wargs)))
        records.append(rec)
    calls = [(fn, a) for _, fn, a in timed]
    if not baseline:
        calls += [(jax.jit(lambda x, w: x @ w), (x, case.w)),
                  (jax.jit(lambda a: a + 1), (case.copy8,)),
                  (jax.jit(lambda a: a + 1), (case.copy4,))]
    if not calls:
        return records
    try:
        ms = device_times(calls, args.reps)
    except Exception as e:  # recorded; the other cases still run
        print(f"  timing {name} M={m} failed: {e}", flush=True)
        for rec, _, _ in timed:
            rec["error"] = f"timing: {type(e).__name__}: {str(e)[:300]}"
        return records
    if not baseline:
        baseline.update(bf16_ms=ms[-3], copy8_ms=ms[-2], copy4_ms=ms[-1])
        ms = ms[:-3]
    for (rec, _, _), t in zip(timed, ms):
        fp8 = not rec["kernel"].startswith("int4")
        nbytes = case.fp8_bytes if fp8 else case.int4_bytes
        copy_ms = baseline["copy8_ms" if fp8 else "copy4_ms"]
        ceiling = 2 * nbytes / (copy_ms * 1e-3)  # bytes read + written per second
        rec.update(us=1e3 * t, bf16_us=1e3 * baseline["bf16_ms"], copy_us=1e3 * copy_ms,
                   bytes=nbytes, tbps=nbytes / (t * 1e-3) / 1e12, copy_tbps=ceiling / 1e12,
                   frac_of_copy=nbytes / (t * 1e-3) / ceiling,
                   speedup_vs_bf16=baseline["bf16_ms"] / t)
        print(f"  {rec['kernel']:4s} {name:8s} M={m:2d} {rec['us']:8.1f} us "
              f"{rec['tbps']:.2f} TB/s ({rec['frac_of_copy']:.0%} of copy) "
              f"x{rec['speedup_vs_bf16']:.2f} bf16  {kw_text(rec['params'])}", flush=True)
    return records


def kw_text(kw):
    return " ".join(f"{k}={v}" for k, v in kw.items())


# -- W8A8 at prefill size ----------------------------------------------------------------------
def run_w8a8(name, k, n, case, args, deadline):
    m = 64 if args.tiny else PREFILL_M
    key = jax.random.key(k * 7 + n)
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    xc = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.bfloat16) * \
        jax.random.uniform(jax.random.fold_in(key, 2), (m, 1), jnp.bfloat16, 0.1, 10)
    # the same FP8 inputs in float32, the product rounded to bf16 where the GEMM writes it so
    # (one scale a channel, on a GPU: XLA:CPU folds the rounding into a float32 dot; the chunked
    # variant's groups keep a float32 product)
    ref = qr.w8a8_reference(xc, case.q, case.scale, product=jnp.bfloat16
                            if jax.default_backend() == "gpu" else jnp.float32)
    ref_groups = qr.w8a8_reference(xc, case.q, case.scale)
    precise = jax.jit(lambda x, q, s: qr.w8a8_matmul(x, q, s))
    fast = jax.jit(lambda x, q, s: qr.w8a8_matmul(x, q, s, fast=True))
    # fast accumulation over 512-row chunks of K only, the chunks summed in float32 (what a
    # kernel that promotes its sums every 512 rows gets), in case HIGHEST costs too much
    chunks = max(1, k // 512)
    chunked = jax.jit(lambda x, q, s: qr.w8a8_matmul(
        x, q, jnp.broadcast_to(s, (chunks, s.shape[1])), fast=True))
    w8a16 = jax.jit(lambda x, q, s: wm.w8a16_matmul(x, q, s, interpret=args.tiny,
                                                    **wm.blocks_for(m, k, n)))
    errs = {}
    for label, fn, want in (("w8a8", precise, ref), ("fast", fast, ref),
                            ("chunked", chunked, ref_groups)):
        errs[label] = check(fn, (xc, case.q, case.scale), want)
    rec = dict(kernel="w8a8", shape=name, k=k, n=n, m=m, limit=LIMIT,
               rel_err=errs["w8a8"][0], rel_err_fast_accum=errs["fast"][0],
               rel_err_chunked_fast_accum=errs["chunked"][0],
               passed=errs["w8a8"][0] is not None and errs["w8a8"][0] <= LIMIT,
               errors={k: e for k, (_, e) in errs.items() if e})
    if time.time() > deadline:
        return rec
    bf16 = jax.jit(lambda x, w: x @ w)
    try:
        ms = device_times([(f, (x, case.q, case.scale)) for f in (precise, fast, chunked, w8a16)]
                          + [(bf16, (x, case.w))], max(10, args.reps // 5))
    except Exception as e:
        rec["error"] = f"timing: {type(e).__name__}: {str(e)[:300]}"
        print(f"  w8a8 {name}: {rec['error']}", flush=True)
        return rec
    flops = 2 * m * k * n
    rec.update(us=1e3 * ms[0], fast_accum_us=1e3 * ms[1], chunked_fast_accum_us=1e3 * ms[2],
               w8a16_us=1e3 * ms[3], bf16_us=1e3 * ms[4], speedup_vs_bf16=ms[4] / ms[0],
               fast_accum_speedup_vs_bf16=ms[4] / ms[1],
               chunked_speedup_vs_bf16=ms[4] / ms[2], tflops=flops / ms[0] / 1e9)
    print(f"  w8a8 {name:8s} M={m} {rec['us']:.1f} us (fast accumulation {rec['fast_accum_us']:.1f})"
          f" chunked {rec['chunked_fast_accum_us']:.1f}; bf16 {rec['bf16_us']:.1f} us "
          f"x{rec['speedup_vs_bf16']:.2f}; rel err {rec['rel_err']} (fast accumulation "
          f"{rec['rel_err_fast_accum']}, chunked {rec['rel_err_chunked_fast_accum']})",
          flush=True)
    return rec


# -- report ----------------------------------------------------------------------------------------
TABLES = {"fp8": "w8a16", "fp8_nk": "w8a16_nk", "int4": "w4a16"}  # tuning.QUANT_MATMUL keys


def best_table(records):
    """The fastest checked variant per (kernel, shape, M)."""
    best = {}
    for r in records:
        if r.get("us") is None or r["kernel"] not in TABLES:
            continue
        key = (r["kernel"], r["shape"], r["m"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return best


def report(records, head):
    best = best_table(records)
    lines = ["| kernel | shape (K x N) | M | best us | bf16 us | TB/s | of copy | vs bf16 | params |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (kernel, shape, m), r in best.items():
        lines.append(f"| {kernel} | {shape} ({r['k']}x{r['n']}) | {m} | {r['us']:.1f} | "
                     f"{r['bf16_us']:.1f} | {r['tbps']:.2f} | {r['frac_of_copy']:.0%} | "
                     f"{r['speedup_vs_bf16']:.2f}x | {kw_text(r['params'])} |")
    for r in records:
        if r["kernel"] == "w8a8":
            lines.append(f"| w8a8 | {r['shape']} ({r['k']}x{r['n']}) | {r['m']} | "
                         f"{r.get('us', float('nan')):.1f} | {r.get('bf16_us', float('nan')):.1f}"
                         f" | | | {r.get('speedup_vs_bf16', float('nan')):.2f}x | rel err "
                         f"{r['rel_err']} (fast accumulation {r['rel_err_fast_accum']}, "
                         f"{r.get('fast_accum_us', float('nan')):.1f} us; 512-row chunks "
                         f"{r['rel_err_chunked_fast_accum']}, "
                         f"{r.get('chunked_fast_accum_us', float('nan')):.1f} us) |")
    entries = {t: {} for t in TABLES.values()}
    for (kernel, shape, m), r in sorted(best.items(), key=lambda e: e[0][2]):
        table = entries[TABLES[kernel]]
        table.setdefault((r["k"], r["n"]), []).append((m, dict(r["params"])))
    snippet = "QUANT_MATMUL = " + pprint.pformat(entries, width=100, sort_dicts=False)
    return "\n".join(lines), entries, snippet


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU)")
    p.add_argument("--reps", type=int, default=50, help="timed calls per variant (median)")
    p.add_argument("--time-limit", type=float, default=225.0,
                   help="seconds; variants past it are skipped and the results written")
    p.add_argument("--tiers", default="1,2")
    p.add_argument("--skip-w8a8", action="store_true", help="only the weight-only kernels")
    p.add_argument("--ms", default=None, help="comma-separated M values (default 1,2,4,16)")
    p.add_argument("--kernels", default="fp8,fp8_nk,int4,w8a8_nk",
                   help="which of fp8 ([K, N]), fp8_nk, int4, w8a8_nk (XLA) to run")
    p.add_argument("--shapes", default=None,
                   help="comma-separated subset of " + ",".join(SHAPES | EXTRA_SHAPES))
    args = p.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.time_limit
    if args.tiny:
        args.reps = min(args.reps, 3)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {s: (SHAPES | EXTRA_SHAPES | TINY_SHAPES)[s] for s in args.shapes.split(",")}
    ms = (1, 4) if args.tiny else MS
    if args.ms:
        ms = tuple(int(m) for m in args.ms.split(","))
    head = common.run_info() | dict(tiny=args.tiny, reps=args.reps)
    print(f"{head['gpu']}, jax {jax.__version__}", flush=True)
    records, baselines, cases = [], {}, {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write():
        table, entries, snippet = report(records, head)
        (out / "sweep_quant.json").write_text(json.dumps(
            dict(head=head, elapsed_s=round(time.time() - t0, 1), records=records), indent=1,
            default=str))
        (out / "sweep_quant.md").write_text(table + "\n\n```\n" + snippet + "\n```\n")
        return table, snippet

    try:
        for name, (k, n) in shapes.items():  # W8A8 first: a short part, never measured before
            cases[name] = Case(jax.random.key(k + n), k, n)
            if time.time() < deadline and not args.skip_w8a8:
                records.append(head | run_w8a8(name, k, n, cases[name], args, deadline))
                write()
        for tier in [int(t) for t in args.tiers.split(",")]:
            for name, (k, n) in shapes.items():
                for m in ms:
                    if time.time() > deadline:
                        break
                    base = baselines.setdefault((name, m), {})
                    records += [head | r for r in run_case(name, k, n, m, cases[name], tier,
                                                           args, deadline, base)]
                    write()
    finally:
        table, snippet = write()
        print(table)
        print("\nkernels/tuning.py entries (M: params, the first M that covers a call wins):")
        print(snippet)
        print(f"{time.time() - t0:.0f} s; wrote {out / 'sweep_quant.json'}")


if __name__ == "__main__":
    main()
