"""Developer benchmarks, run from the repository root: `python -m benchmarks.bench_kernels --out DIR`."""
