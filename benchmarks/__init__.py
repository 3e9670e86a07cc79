"""Developer benchmarks (not installed), run from the repository root:
`python -m benchmarks.bench_kernels --out DIR`. Shared timing and records: `common.py`."""
