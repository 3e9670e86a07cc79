"""Profilers and probes (not installed), run from the repository root:
`python -m profiling.profile_step --out DIR`."""

import benchmarks  # noqa: F401  (puts the root behind site-packages, as benchmarks/ runs)


def profile_each(calls):
    """Run each (fn, args) of `calls` once to compile it, then once more each between
    cuProfilerStart/Stop, so that `ncu --profile-from-start off` profiles only those launches."""
    import ctypes
    import jax
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    cuda = ctypes.CDLL("libcuda.so.1")
    for fn, args in calls:
        cuda.cuProfilerStart()
        jax.block_until_ready(fn(*args))
        cuda.cuProfilerStop()
