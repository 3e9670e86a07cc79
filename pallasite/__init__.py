"""pallasite: a JAX/Pallas inference stack for decoder-only LLMs."""
