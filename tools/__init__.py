"""User-facing tools: plan explorer, benchmarks, converters."""
