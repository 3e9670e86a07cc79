"""Profilers and probes (not installed), run from the repository root:
`python -m profiling.profile_step --out DIR`."""
