"""The embedded default model: a small Llama trained on Python's own documentation, shipped
inside the package so that `pallasite generate` and `pallasite serve` work with no checkpoint."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def default_model_path() -> Path:
    """The folder of the embedded checkpoint (config.json, model.safetensors, tokenizer.json)."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; "
                                "reinstall pallasite or pass a checkpoint folder")
    return DEFAULT_MODEL_DIR
