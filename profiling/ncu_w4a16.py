"""Where the Hopper W4A16 kernel (`kernels/w4a16_mgpu.py`) stalls, instruction by instruction
(Nsight Compute): the library's call on the Llama-3-8B gate/up layer (4096 x 28672, INT4 in
groups of 128) at each of --ms rows, run once each between cuProfilerStart/Stop so that only
those launches are profiled:

    ncu --clock-control none --profile-from-start off --section SourceCounters \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        -o w4a16 python -m profiling.ncu_w4a16 --ms 16,256
    ncu -i w4a16.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python -m profiling.ncu_flash --summarize sass.csv.gz  # stalls by reason, opcode, instruction

GPU only (Hopper).
"""

from __future__ import annotations

import argparse

from profiling import profile_each


def main():
    import jax
    import jax.numpy as jnp
    from benchmarks.w4a16_issue import int4_weight
    from pallasite import kernels
    from pallasite.kernels import w4a16_mgpu as mg
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,256")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=28672)
    args = ap.parse_args()
    s, words_t, _ = int4_weight(args.k, args.n)
    fn = jax.jit(lambda x, w, s: kernels.int_matmul(x, w, s, bits=4, group_size=128,
                                                    layout="nk16"))
    xs = [jax.random.normal(jax.random.key(m), (m, args.k), jnp.bfloat16)
          for m in map(int, args.ms.split(","))]
    profile_each([(fn, (x, words_t, s)) for x in xs])
    for x in xs:
        print(f"profiled M={x.shape[0]}: {mg.blocks_for(x.shape[0], args.n, args.k // 128)}")


if __name__ == "__main__":
    main()
