"""What bounds the one-row INT4 kernel (`kernels/w4a16_gemv.py`): Nsight Compute's sections for
its call at each 8B layer shape, beside XLA reading the same words once.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \\
        --section ComputeWorkloadAnalysis --metrics smsp__inst_executed.sum,dram__bytes_read.sum \\
        --log-file gemv.txt python -m profiling.ncu_gemv

Under ncu the kernels replay with device memory saved and restored: qkv and o took most of 400 s.

Each call runs once between cuProfilerStart/Stop after a marker kernel named for it
(`ncu_decode.marker`). GPU only; the weights are random symmetric INT4 codes in groups of 128.
"""

from __future__ import annotations

import argparse
import ctypes

from benchmarks.bench_w4a16_mgpu import SHAPES


def calls(k, n):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallasite import kernels
    from pallasite.kernels import w4a16_mgpu as mg
    rng = np.random.default_rng(k + n)
    words_t = mg.pack_t(rng.integers(0, 16, (k, n)), 4)
    scale = jnp.asarray(rng.uniform(0.005, 0.02, (k // 128, n)), jnp.float32)
    x = jax.random.normal(jax.random.key(0), (1, k), jnp.bfloat16)
    gemv = jax.jit(lambda x, w, s: kernels.int_matmul(x, w, s, bits=4, group_size=128,
                                                      layout="nk16"))
    read = jax.jit(lambda w: jnp.sum(w, axis=1))
    return {"gemv": (gemv, (x, words_t, scale)), "read": (read, (words_t,))}


def main(argv=None):
    import jax
    from profiling.ncu_decode import marker
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    cuda = ctypes.CDLL("libcuda.so.1")
    for name in args.shapes.split(","):
        for call, (fn, a) in calls(*SHAPES[name]).items():
            mark = marker(f"marker_{name}_{call}")
            jax.block_until_ready((fn(*a), mark()))
            cuda.cuProfilerStart()
            jax.block_until_ready(mark())
            jax.block_until_ready(fn(*a))
            cuda.cuProfilerStop()
            print(f"{name} {call}: profiled", flush=True)


if __name__ == "__main__":
    main()
