"""How the Hopper W4A16 kernel (`kernels/w4a16_mgpu.py`) spends its time between unpacking the
codes and issuing the MMAs: the library's call at `blocks_for`'s tiles, timed as it issues each
plane's MMA as soon as its operand is made (`default`), with the operands of `wait_every`
planes made first and their MMAs awaited together (`waitN`), with other pipeline depths or
tiles (`stagesN`, `bmN`, `bnN`, `splitsN`, joined by `+`), with N warpgroups a CTA sharing
its activation tile (`consN`, first: `blocks_for`'s tiles for them), and with each code's
shift, AND and OR replaced by a bitcast of the word (`bitcast`: wrong numbers, the same loads,
MMAs and stores, so what the integer unpacking costs), beside XLA's bf16 product and the weight
dequantized in the graph before it (the library's path past its rows), at 8B layer shapes.

    python -m benchmarks.w4a16_issue --out DIR          # H100
    MOSAIC_GPU_DUMP_PTXAS=1 python -m benchmarks.w4a16_issue --shapes gate_up --ms 256 --reps 2

Every variant but `bitcast` is checked first against the dequantized weight's product, on other
inputs with freed device memory poisoned (`bench_w4a16_mgpu.check`; relative error <= 1e-2).
Times are the median GPU time over --reps calls, the L2 flushed before each
(`common.device_times`). Writes DIR/w4a16_issue.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import common
from benchmarks.bench_w4a16_mgpu import SHAPES, check
from pallasite.kernels import w4a16_matmul as im
from pallasite.kernels import w4a16_mgpu as mg


def int4_weight(k: int, n: int):
    """Random symmetric INT4 codes in groups of 128: (scale, the Hopper layout's words, the
    weight dequantized to bf16)."""
    rng = np.random.default_rng(k + n)
    codes = rng.integers(0, 16, (k, n))
    scale = rng.uniform(0.005, 0.02, (k // 128, n)).astype(np.float32)
    words, s, _, _ = im.pack_weight(codes, scale, None, bits=4, group_size=128)
    w_bf16 = im.dequantize(words, s, None, bits=4, group_size=128, k=k).astype(jnp.bfloat16)
    return s, mg.pack_t(codes, 4), w_bf16


def compiled(x, words_t, s, variant: str, **kw):
    """The kernel compiled at kw for one variant (see the module's docstring)."""
    real = mg.one_plus
    if variant == "bitcast":
        mg.one_plus = lambda words, j, bits: lax.bitcast_convert_type(words, jnp.float32)
    elif variant != "default":  # e.g. "stages3+wait2": options over the library's tiles
        keys = dict(wait="wait_every", stages="num_stages", bm="block_m", bn="block_n",
                    splits="num_splits", cons="consumers")
        parts = variant.split("+")
        if parts[0].startswith("cons"):  # the library's tiles for that many consumers
            kw = mg.blocks_for(x.shape[0], words_t.shape[0], words_t.shape[1] // mg.SLAB,
                               consumers=int(parts[0][4:]))
        for part in parts:
            name = part.rstrip("0123456789")
            kw = kw | {keys[name]: int(part[len(name):])}
    try:
        def fn(x, w, s):  # int_matmul's body, tracing the kernel afresh (not jit's cached trace)
            y = mg.int_matmul_t.__wrapped__(x, w, s, bits=4, group_size=128, **kw)
            return (y.sum(0) if y.ndim == 3 else y)[:, :x.shape[0]].T.astype(x.dtype)
        return jax.jit(fn).lower(x, words_t, s).compile()
    finally:
        mg.one_plus = real


def dequant_dot(k: int):
    """The library's product above INT_MATMUL_MAX_ROWS: the weight dequantized in the graph,
    then XLA's dot."""
    dims = (((1,), (1,)), ((), ()))
    return jax.jit(lambda x, w, s: lax.dot_general(x, mg.dequantize_t(
        w, s, None, bits=4, group_size=128, k=k).astype(x.dtype), dims))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="qkv,gate_up,down")
    ap.add_argument("--ms", default="16,64,128,256")
    ap.add_argument("--variants", default="default,bitcast,wait8,wait4,wait2")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    info = common.run_info()
    print(json.dumps(info), flush=True)
    variants = args.variants.split(",")
    records = []
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        s, words_t, w_bf16 = int4_weight(k, n)
        for m in map(int, args.ms.split(",")):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xc = jax.random.normal(jax.random.key(m + 1), (m, k), jnp.bfloat16)
            kw = mg.blocks_for(m, n, words_t.shape[1] // mg.SLAB)
            fns, failed = {}, {}
            for v in variants:  # a variant that does not compile (e.g. shared memory) is noted
                try:
                    fns[v] = compiled(x, words_t, s, v, **kw)
                except Exception as e:  # noqa: BLE001
                    failed[v] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{name} M={m} {v}: {failed[v]}", flush=True)
            ref = xc.astype(jnp.float32) @ w_bf16.astype(jnp.float32)
            errs = {v: check(f, (xc, words_t, s), ref)[0] for v, f in fns.items()
                    if v != "bitcast"}
            errs = {v: None if e is None else float(e) for v, e in errs.items()}
            timed = [v for v in fns
                     if v == "bitcast" or (errs[v] is not None and errs[v] <= 1e-2)]
            ts = common.device_times([(fns[v], (x, words_t, s)) for v in timed]
                                     + [(dequant_dot(k), (x, words_t, s)),
                                        (jax.jit(lambda x, w: x @ w), (x, w_bf16))], args.reps)
            bf16_us, dequant_us = 1e3 * ts[-1][0], 1e3 * ts[-2][0]
            rec = dict(shape=name, k=k, n=n, m=m, params=kw, rel_err=errs, bf16_us=bf16_us,
                       dequant_dot_us=dequant_us,
                       us={v: 1e3 * t for v, (t, _) in zip(timed, ts)}, failed=failed)
            records.append(rec)
            print(f"{name} M={m} {kw}: bf16 {bf16_us:.1f} us  dequantized + bf16 "
                  f"{dequant_us:.1f} us  " + "  ".join(
                f"{v} {u:.1f} us ({bf16_us / u:.2f}x)" for v, u in rec["us"].items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w4a16_issue.json"), "w") as f:
        json.dump(dict(info, command=common.command(), records=records), f, indent=1)


if __name__ == "__main__":
    main()
