"""Tiles of the Triton flash kernel at head dim 256 (Gemma 2 and 3), against cuDNN in the same
trace: which tile `tuning.WIDE_HEADS` should name.

    python -m benchmarks.sweep_flash_wide --out $OUT       # GPU

Gemma-3-4B's heads (8 query heads over 4 kv heads), batch 16, 4096 tokens, causal. Each tile
first runs over freshly poisoned memory and must match cuDNN's output (relative error <= 1e-2);
times are the summed device time of a call's kernels, L2 flushed, median of --reps. Writes
OUT/sweep_flash_wide.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.attention import cudnn_attention, dense_inputs
from pallasite import kernels

TILES = [(64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2),
         (128, 32, 8, 3), (32, 64, 4, 3)]  # block_q, block_k, num_warps, num_stages


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    info = common.run_info() | dict(command=common.command())
    print(json.dumps(info), flush=True)
    q, k, v = dense_inputs(jax.random.PRNGKey(3), 16, args.seq, args.seq, 8, 4, 256,
                           jnp.bfloat16)
    ref = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, True))(q, k, v)
    calls, records = [], []
    for bq, bk, w, st in TILES:
        kw = dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
        fn = jax.jit(lambda q, k, v, kw=kw: kernels.flash_attention(
            q, k, v, causal=True, impl="pallas", backend="triton", **kw))
        common.poison()
        try:
            err = common.rel_err(fn(q, k, v), ref)
        except Exception as e:  # a tile past the shared memory: recorded, not fatal
            records.append(dict(info, params=kw, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"{kw}: FAILED {records[-1]['error']}", flush=True)
            continue
        records.append(dict(info, params=kw, rel_err=err))
        if err <= 1e-2:
            calls.append((records[-1], fn))
    times = common.device_times([(fn, (q, k, v)) for _, fn in calls]
                                + [(jax.jit(lambda q, k, v: cudnn_attention(q, k, v, True)),
                                    (q, k, v))], args.reps)
    cudnn = times[-1][0]
    flops = 4 * 16 * 8 * args.seq * args.seq * 256 * 0.5
    for (rec, _), (ms, _) in zip(calls, times):
        rec.update(ms=ms, cudnn_ms=cudnn, ratio_vs_cudnn=cudnn / ms, tflops=flops / ms / 1e9)
        print(f"{rec['params']}: {ms:.3f} ms ({rec['tflops']:.0f} TFLOP/s), cuDNN {cudnn:.3f}"
              f" ms: {cudnn / ms:.2f}x", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_flash_wide.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
