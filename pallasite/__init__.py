"""pallasite: a JAX/Pallas inference stack for decoder-only LLMs.

    import pallasite
    llm = pallasite.LLM()  # the embedded default model; or LLM("path/to/hf/checkpoint")
    llm.generate("The for statement", pallasite.SamplingParams(max_tokens=32))
"""

_EXPORTS = {
    "LLM": "pallasite.serving.llm",
    "SamplingParams": "pallasite.serving.llm",
    "StructuredOutput": "pallasite.serving.structured",
    "Completion": "pallasite.serving.llm",
    "load_hf": "pallasite.model",
    "load_config": "pallasite.model",
    "forward": "pallasite.model",
    "forward_logits": "pallasite.model",
    "default_model_path": "pallasite.model",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    # Imported on first use, so `pallasite --help` and the CLI's subcommands start quickly.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pallasite' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_EXPORTS[name]), name)
