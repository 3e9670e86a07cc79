"""Load Hugging Face safetensors checkpoints into the params pytree, tensor by tensor.

Each parameter is read, converted and placed on its device (or its sharding) before the next is
read, so host memory holds one tensor at a time, never the whole model. Names, shapes and the set
of tensors are checked; a mismatch is an error naming the tensor and the file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from . import quant
from .config import ModelConfig, load_config
from .transformer import param_shapes


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as the config describes."""


# Buffers some exporters save that carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise CheckpointError(f"no *.safetensors weights in {path} (found: {found}); "
                              "only safetensors checkpoints are supported")
    names = {}
    for file in files:
        for name in _open(file).keys():
            names[name] = file
    return names


def _open(file: Path):
    try:
        return safe_open(str(file), framework="flax")
    except Exception as e:  # the library raises several types for a damaged file
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from None


def _layer_sources(config: ModelConfig, i: int) -> dict[tuple, tuple]:
    """For one layer: param path -> (HF tensor names, function building the param from them)."""
    c, p = config, f"model.layers.{i}."
    d, h, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    L = f"layers_{i}"
    t = lambda w: w.T  # HF Linear stores [out, in]; params are [in, out]
    out = {
        (L, "attn_norm", "scale"): ([p + "input_layernorm.weight"], None),
        (L, "mlp_norm", "scale"): ([p + "post_attention_layernorm.weight"], None),
        (L, "attn", "wq"): ([p + "self_attn.q_proj.weight"], lambda w: w.T.reshape(d, h, hd)),
        (L, "attn", "wk"): ([p + "self_attn.k_proj.weight"], lambda w: w.T.reshape(d, kv, hd)),
        (L, "attn", "wv"): ([p + "self_attn.v_proj.weight"], lambda w: w.T.reshape(d, kv, hd)),
        (L, "attn", "wo"): ([p + "self_attn.o_proj.weight"], lambda w: w.T.reshape(h, hd, d)),
    }
    if c.qkv_bias:
        out[(L, "attn", "bq")] = ([p + "self_attn.q_proj.bias"], lambda b: b.reshape(h, hd))
        out[(L, "attn", "bk")] = ([p + "self_attn.k_proj.bias"], lambda b: b.reshape(kv, hd))
        out[(L, "attn", "bv")] = ([p + "self_attn.v_proj.bias"], lambda b: b.reshape(kv, hd))
    if c.qk_norm:
        out[(L, "attn", "q_norm", "scale")] = ([p + "self_attn.q_norm.weight"], None)
        out[(L, "attn", "k_norm", "scale")] = ([p + "self_attn.k_norm.weight"], None)
    if not c.is_moe:
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[(L, "mlp", ours)] = ([f"{p}mlp.{theirs}.weight"], t)
        return out
    if c.model_type == "mixtral":
        block, names = p + "block_sparse_moe.", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
    else:
        block, names = p + "mlp.", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    out[(L, "moe", "router")] = ([block + "gate.weight"], t)
    stack = lambda *ws: np.stack([w.T for w in ws])
    for ours, theirs in names.items():
        out[(L, "moe", ours)] = (
            [f"{block}experts.{e}.{theirs}.weight" for e in range(c.num_experts)], stack)
    return out


def hf_sources(config: ModelConfig) -> dict[tuple, tuple]:
    """Every param path -> (HF tensor names, builder). The inverse is used by export."""
    out = {("embed",): (["model.embed_tokens.weight"], None),
           ("final_norm", "scale"): (["model.norm.weight"], None)}
    if not config.tie_word_embeddings:
        out[("lm_head",)] = (["lm_head.weight"], lambda w: w.T)
    for i in range(config.num_layers):
        out.update(_layer_sources(config, i))
    return out


def _read(name: str, files: dict[str, Path], handles: dict) -> np.ndarray:
    file = files[name]
    if file not in handles:
        handles[file] = _open(file)
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            tensor = handles[file].get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from None
    if tensor.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise CheckpointError(f"tensor {name} in {file} has dtype {tensor.dtype}; "
                              "expected float32, float16 or bfloat16")
    return np.asarray(tensor)


def _set(tree: dict, path: tuple, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def load_hf(path, dtype=jnp.bfloat16, shardings=None, config: ModelConfig | None = None,
            quantization: str | None = None):
    """Load a Hugging Face checkpoint folder. Returns (config, params).

    `dtype` is the target dtype of every parameter, whatever the file holds. `shardings`, a
    pytree like the params of `jax.sharding.Sharding`s, places each parameter straight onto its
    devices; without it each goes to the default device. `quantization="fp8"` stores every
    linear weight as a `quant.QArray` (float8_e4m3fn, float32 per-output-channel scales),
    each quantized on its device(s) right after it is placed, before the next is read.
    """
    quant.check_quantization(quantization)
    path = Path(path)
    config = config or load_config(path)
    files = _tensor_files(path)
    sources = hf_sources(config)
    expected = param_shapes(config, dtype)
    from .quant_int import int_checkpoint
    ints = int_checkpoint(path, config, sources, expected, files)
    if ints is not None:
        if quantization or shardings is not None:
            raise CheckpointError(f"checkpoint {path} is already quantized ({ints.method}): "
                                  "it loads as stored, on one device (no quantization=, no mesh)")
        for param_path in ints.linears:
            sources.pop(param_path)
    wanted = {name for names, _ in sources.values() for name in names}
    wanted |= ints.names() if ints is not None else set()
    missing = sorted(wanted - files.keys())
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor(s) {missing[:5]}{more}")
    tied_head = config.tie_word_embeddings and "lm_head.weight" in files
    extra = sorted(n for n in files.keys() - wanted
                   if not n.endswith(IGNORED_SUFFIXES) and not (tied_head and n == "lm_head.weight"))
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensor(s) the {config.model_type} config "
                              f"does not use: {extra[:5]} (in {files[extra[0]].name})")
    handles, params = {}, {}
    for param_path, (names, build) in sources.items():
        arrays = [_read(n, files, handles) for n in names]
        want = _get(expected, param_path)
        try:
            value = build(*arrays) if build else arrays[0]
        except ValueError:  # a reshape that cannot fit: reported as the shape error below
            value = None
        if value is None or value.shape != want.shape:
            raise CheckpointError(
                f"tensor {names[0]} in {files[names[0]].name} has shape {arrays[0].shape}, which "
                f"does not fit {'.'.join(param_path)} {tuple(want.shape)} of this config")
        sharding = None if shardings is None else _get(shardings, param_path)
        value = jnp.asarray(value, dtype) if sharding is None else jax.device_put(
            value.astype(dtype), sharding)
        if quantization and quant.linear_axes(param_path) is not None:
            value = _quantize_in_place(value, quant.contract_axes_of(param_path), sharding,
                                       quantization, quant.linear_axes(param_path))
        _set(params, param_path, value)
    for param_path in ints.linears if ints is not None else ():
        _set(params, param_path, ints.load(param_path, lambda n: _read_raw(n, files, handles)))
    return config, params


def _read_raw(name: str, files: dict[str, Path], handles: dict) -> np.ndarray:
    """A tensor as stored (integer tensors of quantized checkpoints too)."""
    file = files[name]
    if file not in handles:
        handles[file] = _open(file)
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(handles[file].get_tensor(name))


def _quantize_in_place(value, contract_axes, sharding, quantization="fp8", axes=None):
    """FP8 of a placed weight on the devices holding it: each its shard, the per-channel amax
    reduced across shards of the contraction axes. The input is dropped once this returns.
    Integer modes (w4a16, w8a16) quantize dense linears RTN and repack them on one device."""
    if quantization != "fp8":
        from .quant_int import quantize_weight
        if sharding is not None:
            raise CheckpointError(f"quantization={quantization!r} on a mesh is not supported yet")
        return value if axes[0] != 0 else quantize_weight(value, axes[1], quantization)
    shapes = jax.eval_shape(lambda w: quant.quantize_fp8(w, contract_axes), value)
    return _quantizer(contract_axes, quant.sharding_for(shapes, sharding))(value)


@functools.lru_cache(maxsize=64)
def _quantizer(contract_axes, out_shardings):
    return jax.jit(lambda w: quant.quantize_fp8(w, contract_axes), out_shardings=out_shardings)
