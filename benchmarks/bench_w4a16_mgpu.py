"""The Hopper W4A16 kernel (`kernels/w4a16_mgpu.py`, the dequantized weight as the MMA's register
operand) against the library's two paths (`kernels.int_matmul`: with the Triton layout the
Pallas Triton kernel up to INT_MATMUL_MAX_ROWS rows, with the Hopper layout this kernel at the
library's tiles; above, the weight dequantized in the graph then XLA's dot), the
dequantize-then-dot form at every M, and XLA's bf16 product, at Llama-3-8B layer shapes and M
from 1 to 1024, for each weight form of `--quant-forms` (default INT4 in symmetric groups of
128; zero points, act-order, INT8 and other group sizes on request). On request also the
few-row kernel on the same words (`kernels/w4a16_gemv.py`, `--forms gemv`), XLA reading the
words once (`read`: the floor for a product that reads them) and torch's tinygemm INT4
(`tinygemm`, timed with torch's CUDA events over a CUDA graph of weight copies that exceed
the L2, as `benchmarks/bench_int4.py` times it), and the Hopper kernel on int4 tiles
(`--forms i4`, `unpack="int4"`).

    python -m benchmarks.bench_w4a16_mgpu --out DIR            # H100
    python -m benchmarks.bench_w4a16_mgpu --out DIR --forms library,library_hopper \
        --quant-forms int4_g128_zero,int4_g128_zero_perm,int8_gk   # the checkpoint forms
    python -m benchmarks.bench_w4a16_mgpu --tiny --out DIR     # CPU, interpret mode

Every variant is first checked against `w4a16_matmul.int_matmul_reference` on fresh random
inputs with freed device memory poisoned (relative error <= 1e-2: the Hopper kernel and the
dequantize-then-dot form round each weight to bf16); one that fails to compile or to match is
recorded and not timed. Times are the median over --reps calls of the GPU time of the kernels one
call launches, the L2 flushed before each (`common.device_times`), the wrapper's transpose and
split-K sum included. Writes DIR/bench_w4a16_mgpu.json and prints the best of each form.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from pallasite import kernels
from pallasite.kernels import w4a16_gemv as gv
from pallasite.kernels import w4a16_matmul as im
from pallasite.kernels import w4a16_mgpu as mg

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
MS = (1, 16, 64, 128, 256, 512, 1024)
LIMIT = 1e-2


def mgpu_variants(m, n, k_tiles, tiny):
    """64/128/256 output columns, row blocks, the library's split rule
    (`w4a16_mgpu.blocks_for`) or none, and two warpgroups a CTA at the library's tiles for them.
    256 columns over 64 rows hold as large an accumulator as 128 x 128 and read each activation
    tile for twice the columns."""
    if tiny:
        return [dict(block_n=64), dict(block_n=64, num_splits=2, unpack="convert")]
    bms = [None] if m <= 64 else [64, 128] if m == 128 else [64, 128, 256]
    out = []
    for bn, bm in itertools.product((64, 128, 256), bms):
        rows = bm or mg.rows_block(m)
        if bn * rows > 16384 or (bn == 64 and rows < 128 and m > 64):
            continue  # the accumulator's registers; narrow tiles only where they can pay
        rule = mg.blocks_for(m, n, k_tiles, consumers=1)["num_splits"]
        for splits in sorted({1, rule}):
            out.append(dict(block_n=bn, num_splits=splits,
                            **({} if bm is None else dict(block_m=bm))))
    return out + [mg.blocks_for(m, n, k_tiles, consumers=2)] * (n % 256 == 0)


def gemv_variants(m, n, k_tiles, tiny, near=False):
    """The library's tiles (`w4a16_gemv.blocks_for`) and their neighbours: half to four times
    the split, 4 or 8 warps, 2 or 4 K tiles a step, 32 columns; the rule's tiles without the
    fused multiply-add, with Triton's pipeline, and with codes unpacked by a shift a code
    (`unpack="one_plus"`). `near`: the rule, four neighbours and the shifts."""
    if tiny:
        return [dict(block_n=32, tiles_step=2, num_splits=2)]
    rule = gv.blocks_for(m, n, k_tiles)
    s = rule["num_splits"]
    if near:
        return [rule, rule | dict(tiles_step=6 - rule["tiles_step"]), rule | dict(num_warps=8),
                rule | dict(block_n=32), rule | dict(num_splits=max(1, s // 2)),
                rule | dict(unpack="one_plus")]
    out = [rule | dict(num_splits=sp, num_warps=w, tiles_step=t)
           for sp, w, t in itertools.product(sorted({max(1, s // 2), s, 2 * s, min(4 * s, 32)}),
                                             (4, 8), (2, 4))]
    return out + [rule | dict(block_n=32), rule | dict(fused=False), rule | dict(num_stages=3),
                  rule | dict(unpack="one_plus")]


def i4_variants(m, n, k_tiles, tiny):
    """`unpack="int4"` (the weight as XLA's int4 type) at the library's tiles for it
    (`w4a16_mgpu.i4_blocks`), with a deeper ring, half the columns a CTA, twice the split, and up
    to 8 rows an 8-row MMA."""
    if tiny:
        return [dict(block_n=64, unpack="int4"), dict(block_n=64, num_splits=2, unpack="int4")]
    base = {k: v for k, v in mg.i4_blocks(m, n, k_tiles).items() if k != "unpack"}
    splits = base.get("num_splits", 1)
    out = [base, dict(base, num_stages=4), dict(base, block_n=64),
           dict(base, block_n=64, num_stages=4)]
    if k_tiles % (2 * splits) == 0:
        out.append(dict(base, num_splits=2 * splits, num_stages=4))
    if m <= 8:  # an MMA 16 rows wide, as the words' tiles
        out += [dict(base, block_m=16), dict(base, block_m=16, num_stages=2)]
    return [dict(kw, unpack="int4") for kw in out]


def tinygemm_us(k, n, ms, form):
    """torch's `_weight_int4pack_mm` (INT4, symmetric groups of 128) at each M, in us, or {}."""
    if form["bits"] != 4 or form["group"] != 128 or form["zero"] or form["perm"]:
        return {}
    from benchmarks.bench_int4 import copies_for, torch_tinygemm
    ms = [m for m in ms if m <= 16]
    got = torch_tinygemm(k, n, ms, copies_for(k * n // 2), np.random.default_rng(0))
    if not isinstance(got, dict):
        print(f"  tinygemm: {got}", flush=True)
        return {}
    return {m: 1e3 * t for m, t in got.items()}


def check(fn, args, ref):
    common.poison()
    try:
        out = jax.block_until_ready(fn(*args))
    except Exception as e:  # a variant that does not compile is recorded, not fatal
        return None, f"{type(e).__name__}: {str(e)[:400]}"
    return common.rel_err(out, ref), None


def parse_form(form: str) -> dict:
    """'int4_g128' -> bits 4, group 128, symmetric; '_zero' adds zero points (AWQ, asymmetric
    GPTQ), '_perm' a K permutation (GPTQ act-order); 'gk': one group a column (channel)."""
    parts = form.split("_")
    bits, group = parts[0], parts[1] if len(parts) > 1 else ""
    if bits not in ("int4", "int8") or not group.startswith("g") or not (
            group[1:] == "k" or group[1:].isdigit()) or set(parts[2:]) - {"zero", "perm"}:
        raise ValueError(f"--quant-forms {form!r}: write int4|int8 _gN|_gk [_zero] [_perm]")
    return dict(name=form, bits=int(bits[3:]), group=None if group[1:] == "k" else int(group[1:]),
                zero="zero" in parts, perm="perm" in parts)


def xla_int4_args(codes, scale):
    """Symmetric codes as XLA's int4 type (two a byte, [K, N]) and the bf16 group scales."""
    return (jnp.asarray(codes - 8, jnp.int4), jnp.asarray(scale, jnp.bfloat16))


def xla_int4_weight(w, scale, group):
    """The int4 weight scaled in the graph, for XLA to fuse into its product's operand."""
    k, n = w.shape
    return (w.astype(jnp.bfloat16).reshape(k // group, group, n)
            * scale[:, None, :]).reshape(k, n)


def run_shape(name, k, n, ms, args, deadline, form=None):
    form = form or parse_form("int4_g128")
    bits = form["bits"]
    group = form["group"] or k
    rng = np.random.default_rng(k * 7 + n)
    codes = rng.integers(0, 1 << bits, (k, n))
    scale = rng.uniform(0.005, 0.02, (-(-k // group), n)).astype(np.float32)
    zero = rng.integers(0, 1 << bits, scale.shape).astype(np.float32) if form["zero"] else None
    perm = jnp.asarray(rng.permutation(k).astype(np.int32)) if form["perm"] else None
    words, s, z, g = im.pack_weight(codes, scale, zero, bits=bits, group_size=group)
    words_t = mg.pack_t(codes, bits)  # the Hopper kernel's layout, made once as at load
    w_bf16 = im.dequantize(words, s, z, bits=bits, group_size=g, k=k).astype(jnp.bfloat16)
    interpret = args.tiny
    records = []
    tg = {} if args.tiny or "tinygemm" not in args.forms.split(",") else tinygemm_us(
        k, n, ms, form)  # timed by torch's CUDA events in this process, no L2 flush
    for m in ms:
        if time.time() > deadline:
            break
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        xc = jax.random.normal(jax.random.key(m + 1), (m, k), jnp.bfloat16)
        ref = im.int_matmul_reference(xc, words, s, z, perm, bits=bits, group_size=g)
        kw_w = dict(bits=bits, group_size=g, interpret=interpret)
        jobs = [("mgpu", kw, jax.jit(lambda x, w, s, z, kw=kw: mg.int_matmul(
                    x, w, s, z, perm, **kw_w, **kw)), (words_t, s, z))
                for kw in mgpu_variants(m, n, words_t.shape[1] // 16, args.tiny)]
        if bits == 4 and group % 128 == 0 and not form["zero"]:
            w_i4 = mg.pack_i4(codes)
            jobs += [("i4", kw, jax.jit(lambda x, w, s, kw=kw: mg.int_matmul(
                        x, w, s, None, perm, **kw_w, **kw)), (w_i4, s))
                     for kw in i4_variants(m, n, words_t.shape[1] // 16, args.tiny)]
        if m <= gv.MAX_ROWS:
            jobs += [("gemv", kw, jax.jit(lambda x, w, s, z, kw=kw: gv.int_matmul(
                        x, w, s, z, perm, **kw_w, **kw)), (words_t, s, z))
                     for kw in gemv_variants(m, n, words_t.shape[1] // 16, args.tiny,
                                             args.gemv_tiles == "near")]
        jobs.append(("library", {}, jax.jit(lambda x, w, s, z: kernels.int_matmul(
            x, w, s, z, perm, **kw_w)), (words, s, z)))
        jobs.append(("library_hopper", {}, jax.jit(lambda x, w, s, z: kernels.int_matmul(
            x, w, s, z, perm, layout="nk16", **kw_w)), (words_t, s, z)))
        jobs.append(("dequant_dot", {}, jax.jit(lambda x, w, s, z: (
            x if perm is None else x[:, perm]) @ im.dequantize(
            w, s, z, bits=bits, group_size=g, k=k).astype(x.dtype)), (words, s, z)))
        if bits == 4 and not form["zero"] and perm is None:  # XLA's own int4: may fuse
            jobs.append(("xla_int4", {}, jax.jit(lambda x, w, s: x @ xla_int4_weight(
                w, s, g).astype(x.dtype)), xla_int4_args(codes, s)))
        jobs = [j for j in jobs if j[0] in args.forms.split(",")]
        timed = []
        for kernel, kw, fn, wargs in jobs:
            err, fail = check(fn, (xc, *wargs), ref)
            rec = dict(kernel=kernel, shape=name, k=k, n=n, m=m, params=kw, rel_err=err,
                       form=form["name"])
            if fail or err is None or not err <= LIMIT:
                rec["error"] = fail or f"relative error {err} > {LIMIT}"
                print(f"  {kernel} {name} M={m} {kw}: FAILED {rec['error'][:300]}", flush=True)
            else:
                timed.append((rec, fn, (x, *wargs)))
            records.append(rec)
        if "read" in args.forms.split(","):  # XLA reading the same words once: a floor
            rec = dict(kernel="read", shape=name, k=k, n=n, m=m, params={}, form=form["name"])
            records.append(rec)
            timed.append((rec, jax.jit(lambda w: jnp.sum(w, axis=1)), (words_t,)))
        calls = [(fn, a) for _, fn, a in timed] + [(jax.jit(lambda x, w: x @ w), (x, w_bf16))]
        try:
            ts = common.device_times(calls, args.reps)
        except Exception as e:
            print(f"  timing {name} M={m} failed: {e}", flush=True)
            continue
        bf16_us = 1e3 * ts[-1][0]
        for (rec, _, _), (t, _) in zip(timed, ts):
            rec.update(us=1e3 * t, bf16_us=bf16_us, speedup_vs_bf16=bf16_us / (1e3 * t))
        if m in tg:
            timed.append((dict(kernel="tinygemm", shape=name, k=k, n=n, m=m, params={},
                               form=form["name"], us=tg[m], bf16_us=bf16_us,
                               speedup_vs_bf16=bf16_us / tg[m]), None, None))
            records.append(timed[-1][0])
        best = {}
        for rec, _, _ in timed:
            if "us" in rec and (rec["kernel"] not in best or rec["us"] < best[rec["kernel"]]["us"]):
                best[rec["kernel"]] = rec
        line = "  ".join(f"{k_} {r['us']:.1f} us ({r['speedup_vs_bf16']:.2f}x)"
                         for k_, r in best.items())
        print(f"{form['name']} {name} M={m}: bf16 {bf16_us:.1f} us  {line}  best mgpu "
              f"{best.get('mgpu', {}).get('params')} gemv {best.get('gemv', {}).get('params')}",
              flush=True)
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--forms", default="mgpu,library,library_hopper,dequant_dot,xla_int4",
                    help="which forms to time: mgpu (each tile variant), i4 (the Hopper "
                         "kernel on int4 tiles, symmetric INT4), gemv (each tile "
                         "variant of the few-row kernel), library (the Triton layout's path), "
                         "library_hopper (the Hopper layout's), dequant_dot, xla_int4 (XLA's "
                         "int4 type scaled in the graph; symmetric INT4), read (XLA summing the "
                         "words: one read of them), tinygemm (torch's INT4 kernel, g128)")
    ap.add_argument("--quant-forms", default="int4_g128",
                    help="weight forms, comma-separated: int4|int8 _gN|_gk (one group a column) "
                         "[_zero] (zero points) [_perm] (act-order), e.g. int4_g128_zero")
    ap.add_argument("--gemv-tiles", default="all", choices=("all", "near"),
                    help="gemv: the whole sweep, or the library's tiles and four neighbours")
    ap.add_argument("--time-limit", type=float, default=500)
    args = ap.parse_args(argv)
    deadline = time.time() + args.time_limit
    info = common.run_info()
    print(json.dumps(info), flush=True)
    shapes = {"tiny": (512, 128)} if args.tiny else {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = [3, 20] if args.tiny else [int(v) for v in args.ms.split(",")]
    records = []
    forms = [parse_form(f) for f in args.quant_forms.split(",")]
    for form, (name, (k, n)) in itertools.product(forms, shapes.items()):
        records += run_shape(name, k, n, ms, args, deadline, form)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_w4a16_mgpu.json"), "w") as f:
            json.dump(dict(info, command=common.command(), records=records), f, indent=1)
    return records


if __name__ == "__main__":
    main()
