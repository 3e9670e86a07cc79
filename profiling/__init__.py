"""Profilers and probes, run from the repository root: `python -m profiling.profile_step --out DIR`."""
