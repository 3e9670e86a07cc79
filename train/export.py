"""Export params to a Hugging Face folder that both `pallasite.LLM` and `transformers` load.

Tensor names and layouts come from the loader's own table (`hf_sources`), inverted: a param kept
as-is is written as-is; every other one is a Linear weight, which HF stores [out, in] with the
"embed" axis on one side, or a bias, which HF stores flat. Each inverted tensor is run back through
the loader's builder and must reproduce the param exactly, so export and load cannot drift apart.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.flax import save_file

from ..model import ModelConfig, hf_sources, param_logical_axes, to_hf_dict


class ExportError(RuntimeError):
    pass


def _linear_to_hf(value: np.ndarray, axes: tuple) -> np.ndarray:
    """A param [in axes..., out axes...] as HF's [out, in]; the input side ends at "embed" when
    embed comes first, and is everything before "embed" otherwise (wo, w_down)."""
    if "embed" not in axes:
        return value.reshape(-1)  # a bias
    split = 1 if axes[0] == "embed" else axes.index("embed")
    return value.reshape(math.prod(value.shape[:split]), -1).T


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def hf_tensors(params, config: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensor name -> float32 numpy array, for every tensor the loader expects."""
    logical = param_logical_axes(config)
    out = {}
    for path, (names, build) in hf_sources(config).items():
        value = np.asarray(_get(params, path), np.float32)
        axes = tuple(_get(logical, path))
        if len(names) > 1:  # experts stacked on the first axis, one HF tensor each
            parts, axes = list(value), axes[1:]
        else:
            parts = [value]
        tensors = parts if build is None else [np.ascontiguousarray(_linear_to_hf(p, axes))
                                               for p in parts]
        rebuilt = tensors[0] if build is None else build(*tensors)
        if not np.array_equal(np.asarray(rebuilt), value):
            raise ExportError(f"export of {'.'.join(path)} does not load back as itself")
        out.update(zip(names, tensors))
    return out


def export_hf(params, config: ModelConfig, out_dir, tokenizer_dir=None, dtype=jnp.float32,
              generation: dict | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and (from `tokenizer_dir`)
    tokenizer.json + tokenizer_config.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: jnp.asarray(v, dtype) for k, v in hf_tensors(params, config).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {**to_hf_dict(config), "torch_dtype": jnp.dtype(dtype).name}
    _write_json(out / "config.json", hf_config)
    eos = list(config.eos_token_ids)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        **(generation or {})})
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out, config)
    return out


def _copy_tokenizer(src: Path, out: Path, config: ModelConfig):
    if not (src / "tokenizer.json").is_file():
        raise ExportError(f"no tokenizer.json in {src}")
    if src.resolve() == out.resolve():
        return
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    if (src / "tokenizer_config.json").is_file():
        shutil.copyfile(src / "tokenizer_config.json", out / "tokenizer_config.json")
    else:
        _write_json(out / "tokenizer_config.json", tokenizer_config(src / "tokenizer.json", config))


def tokenizer_config(tokenizer_file: Path, config: ModelConfig) -> dict:
    """A minimal `tokenizer_config.json` for a `tokenizers` file (used with transformers)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    name = lambda i: None if i is None else tok.id_to_token(i)
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(config.bos_token_id),
            "eos_token": name(eos), "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False}


def _write_json(path: Path, obj: dict):
    path.write_text(json.dumps(obj, indent=2) + "\n")
