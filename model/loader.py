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

from . import deepseek, fp8_checkpoint, quant
from .config import DEEPSEEK, ModelConfig, load_config
from .errors import CheckpointError
from .transformer import param_shapes


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
    if config.model_type in DEEPSEEK:
        return deepseek.layer_sources(config, i)
    c, p = config, f"model.layers.{i}."
    d, h, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    L = f"layers_{i}"
    t = lambda w: w.T  # HF Linear stores [out, in]; params are [in, out]
    out = {(L, "attn_norm", "scale"): ([p + "input_layernorm.weight"], None)}
    if c.sandwich_norms:  # Gemma: norms after attention and around the MLP
        out[(L, "attn_post_norm", "scale")] = ([p + "post_attention_layernorm.weight"], None)
        out[(L, "mlp_norm", "scale")] = ([p + "pre_feedforward_layernorm.weight"], None)
        out[(L, "mlp_post_norm", "scale")] = ([p + "post_feedforward_layernorm.weight"], None)
    else:
        out[(L, "mlp_norm", "scale")] = ([p + "post_attention_layernorm.weight"], None)
    if c.model_type == "phi3":  # one fused projection each for q|k|v and gate|up, split here
        qkv, rows = [p + "self_attn.qkv_proj.weight"], np.cumsum([0, h * hd, kv * hd, kv * hd])
        part = lambda i, n: lambda w: w[rows[i]:rows[i + 1]].T.reshape(d, n, hd)
        out[(L, "attn", "wq")], out[(L, "attn", "wk")], out[(L, "attn", "wv")] = (
            (qkv, part(0, h)), (qkv, part(1, kv)), (qkv, part(2, kv)))
        out[(L, "attn", "wo")] = ([p + "self_attn.o_proj.weight"], lambda w: w.T.reshape(h, hd, d))
        gate_up, f = [p + "mlp.gate_up_proj.weight"], c.intermediate_size
        out[(L, "mlp", "w_gate")] = (gate_up, lambda w: w[:f].T)
        out[(L, "mlp", "w_up")] = (gate_up, lambda w: w[f:].T)
        out[(L, "mlp", "w_down")] = ([p + "mlp.down_proj.weight"], t)
        return out
    out.update({
        (L, "attn", "wq"): ([p + "self_attn.q_proj.weight"], lambda w: w.T.reshape(d, h, hd)),
        (L, "attn", "wk"): ([p + "self_attn.k_proj.weight"], lambda w: w.T.reshape(d, kv, hd)),
        (L, "attn", "wv"): ([p + "self_attn.v_proj.weight"], lambda w: w.T.reshape(d, kv, hd)),
        (L, "attn", "wo"): ([p + "self_attn.o_proj.weight"], lambda w: w.T.reshape(h, hd, d)),
    })
    if c.o_bias:
        out[(L, "attn", "bo")] = ([p + "self_attn.o_proj.bias"], None)
    if c.sinks:
        out[(L, "attn", "sinks")] = ([p + "self_attn.sinks"], None)
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
    if c.model_type == "gpt_oss":
        out.update(_gpt_oss_experts(c, p, L))
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


def _gpt_oss_experts(c: ModelConfig, p: str, L: str) -> dict[tuple, tuple]:
    """GPT-OSS keeps all experts in one tensor per projection, stored [E, in, out], gate and up
    interleaved along out; or as MXFP4 blocks and scales of the [E, out, in] weights."""
    x = p + "mlp.experts."
    gate, up = (lambda w: w[..., ::2]), (lambda w: w[..., 1::2])
    if c.expert_weights == "mxfp4":
        gate_up = [x + "gate_up_proj_blocks", x + "gate_up_proj_scales"]
        down = [x + "down_proj_blocks", x + "down_proj_scales"]
        deq = lambda blocks, scales: np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2)
        w_gate, w_up, w_down = (lambda b, s: gate(deq(b, s))), (lambda b, s: up(deq(b, s))), deq
    else:
        gate_up, down = [x + "gate_up_proj"], [x + "down_proj"]
        w_gate, w_up, w_down = gate, up, None
    return {
        (L, "moe", "router"): ([p + "mlp.router.weight"], lambda w: w.T),
        (L, "moe", "router_bias"): ([p + "mlp.router.bias"], None),
        (L, "moe", "w_gate"): (gate_up, w_gate),
        (L, "moe", "w_up"): (gate_up, w_up),
        (L, "moe", "w_down"): (down, w_down),
        (L, "moe", "b_gate"): ([x + "gate_up_proj_bias"], gate),
        (L, "moe", "b_up"): ([x + "gate_up_proj_bias"], up),
        (L, "moe", "b_down"): ([x + "down_proj_bias"], None),
    }


# FP4 E2M1 by its 4-bit code (sign, 2 exponent bits, 1 mantissa bit; low nibble first in a byte).
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32. blocks [..., G, 16] uint8 (32 FP4 values per block, two a byte),
    scales [..., G] uint8 E8M0 (2 ** (s - 127)) -> [..., G * 32]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape}")
    values = np.stack([FP4_E2M1[blocks & 0x0F], FP4_E2M1[blocks >> 4]], axis=-1)
    values = values.reshape(*scales.shape, 32)
    out = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*scales.shape[:-1], -1)


def hf_sources(config: ModelConfig) -> dict[tuple, tuple]:
    """Every param path -> (HF tensor names, builder). The inverse is used by export."""
    out = {("embed",): (["model.embed_tokens.weight"], None),
           ("final_norm", "scale"): (["model.norm.weight"], None)}
    if not config.tie_word_embeddings:
        out[("lm_head",)] = (["lm_head.weight"], lambda w: w.T)
    for i in range(config.num_layers):
        out.update(_layer_sources(config, i))
    return out


def _stored_dtype(name: str, files: dict[str, Path], handles: dict) -> str:
    """The safetensors dtype string ("BF16", "F8_E4M3", ...) of a tensor, without reading it."""
    file = files[name]
    if file not in handles:
        handles[file] = _open(file)
    try:
        return handles[file].get_slice(name).get_dtype()
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from None


def _read_fp8(name: str, file: Path) -> np.ndarray:
    """An F8_E4M3 tensor straight from the file (the safetensors numpy/flax readers have no
    float8 type): the header's offsets, the bytes viewed as ml_dtypes' float8_e4m3fn."""
    import ml_dtypes
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))[name]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        raw = np.frombuffer(f.read(end - start), np.uint8)
    return raw.view(ml_dtypes.float8_e4m3fn).reshape(meta["shape"])


def _read(name: str, files: dict[str, Path], handles: dict,
          quantized_ok: bool = False) -> np.ndarray:
    file = files[name]
    if _stored_dtype(name, files, handles) == "F8_E4M3":
        if not quantized_ok:
            raise CheckpointError(f"tensor {name} in {file} is stored in FP8 without a scale "
                                  "this loader knows of (config.json has no quantization_config "
                                  "naming it)")
        return _read_fp8(name, file)
    if file not in handles:
        handles[file] = _open(file)
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            tensor = handles[file].get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {file}: {e}") from None
    packed = name.endswith(("_blocks", "_scales"))  # MXFP4 experts: bytes
    floats = (jnp.float32, jnp.float16, jnp.bfloat16)
    if tensor.dtype not in ((jnp.uint8,) if packed else floats + (
            (jnp.int8,) if quantized_ok else ())):
        raise CheckpointError(f"tensor {name} in {file} has dtype {tensor.dtype}; "
                              f"expected {'uint8' if packed else 'float32, float16 or bfloat16'}")
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
    fp8 = _fp8_format(path) if ints is None else None
    wanted = {name for names, _ in sources.values() for name in names}
    wanted |= ints.names() if ints is not None else set()
    stored_fp8 = set()
    if fp8 is not None:  # each FP8/INT8 weight brings its scale; a static input scale may too
        handles = {}
        stored_fp8 = {n for n in wanted & files.keys()
                      if _stored_dtype(n, files, handles) == fp8.stored}
        for name in sorted(stored_fp8):
            if not fp8.quantized(name):
                raise CheckpointError(f"tensor {name} is stored as {fp8.scheme}, but the "
                                      "checkpoint's quantization_config leaves its module "
                                      "unquantized (ignore / modules_to_not_convert)")
        wanted |= {fp8.scale_name(n) for n in stored_fp8}
        optional = {fp8.input_scale_name(n) for n in stored_fp8} & files.keys()
        for name in sorted(optional):
            _check_input_scale(name, _read(name, files, handles))
        wanted |= optional
    missing = sorted(wanted - files.keys())
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor(s) {missing[:5]}{more}")
    tied_head = config.tie_word_embeddings and "lm_head.weight" in files
    extra = sorted(n for n in files.keys() - wanted
                   if not n.endswith(IGNORED_SUFFIXES) and not (tied_head and n == "lm_head.weight")
                   and not deepseek.is_extra_layer(n, config))
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensor(s) the {config.model_type} config "
                              f"does not use: {extra[:5]} (in {files[extra[0]].name})")
    handles, params = {}, {}
    for param_path, (names, build) in sources.items():
        want = _get(expected, param_path)
        if names[0] in stored_fp8:
            value = _fp8_param(fp8, param_path, names, build, want, files, handles)
            if quant.is_quantized(value):
                sharding = None if shardings is None else _get(shardings, param_path)
                value = jax.tree.map(jnp.asarray, value) if sharding is None else \
                    jax.device_put(value, quant.sharding_for(value, sharding))
                _set(params, param_path, value)
                continue
            arrays = None  # a weight our model keeps in `dtype`: dequantized on the host
        else:
            arrays = [_read(n, files, handles) for n in names]
            try:
                value = build(*arrays) if build else arrays[0]
            except ValueError:  # a reshape that cannot fit: reported as the shape error below
                value = None
        if value is None or value.shape != want.shape:
            arrays = arrays or [_read(names[0], files, handles, quantized_ok=True)]
            raise CheckpointError(
                f"tensor {names[0]} in {files[names[0]].name} has shape {arrays[0].shape}, which "
                f"does not fit {'.'.join(param_path)} {tuple(want.shape)} of this config")
        sharding = None if shardings is None else _get(shardings, param_path)
        # Each param in its own dtype: `dtype`, but float32 for DeepSeek-V3's score bias.
        value = jnp.asarray(value, want.dtype) if sharding is None else jax.device_put(
            value.astype(want.dtype), sharding)
        if quantization and quant.linear_axes(param_path) is not None:
            value = _quantize_in_place(value, sharding, quantization,
                                       quant.linear_axes(param_path))
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


def _quantize_in_place(value, sharding, quantization, axes):
    """FP8 of a placed weight on the devices holding it: each its shard, the per-channel amax
    reduced across shards of the contraction axes. The input is dropped once this returns.
    Integer modes (w4a16, w8a16) quantize linears RTN (MoE experts one by one) and repack them
    on one device."""
    if quantization != "fp8":
        from .quant_int import quantize_weight
        if sharding is not None:
            raise CheckpointError(f"quantization={quantization!r} on a mesh is not supported yet")
        return quantize_weight(value, axes[1], quantization, lead=axes[0])
    shapes = jax.eval_shape(lambda w: quant.quantize_linear(w, axes), value)
    return _quantizer(axes, quant.sharding_for(shapes, sharding))(value)


@functools.lru_cache(maxsize=64)
def _quantizer(axes, out_shardings):
    return jax.jit(lambda w: quant.quantize_linear(w, axes), out_shardings=out_shardings)


# -- published FP8 checkpoints (model/fp8_checkpoint.py) ---------------------------------------------
def _fp8_format(path: Path):
    """The checkpoint's FP8 format, None for a plain one; CheckpointError for one not read."""
    config_file = path / "config.json"
    try:
        qc = json.loads(config_file.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qc or qc.get("quant_method") == "mxfp4":  # gpt_oss's experts: read with the family
        return None
    try:
        return fp8_checkpoint.Fp8Format(qc)
    except fp8_checkpoint.FormatError as e:
        raise CheckpointError(f"{config_file}: quantization_config: {e}") from None


def _check_input_scale(name, scale):
    s = np.asarray(scale, np.float32)
    if s.size != 1 or not np.isfinite(s).all() or (s <= 0).any():
        raise CheckpointError(f"{name} must be one positive scale (per-tensor static input "
                              f"scale), not shape {tuple(s.shape)} with values {s.ravel()[:4]}")


def _fp8_param(fp8, param_path, names, build, want, files, handles):
    """A QArray for a linear weight (values transposed as `build` does, scales likewise), or
    the dequantized float32 array for any other param stored quantized (an LM head, a router)."""
    qs, scales = [], []
    dtype = "int8" if fp8.scheme == "int8" else "float8_e4m3fn"
    for n in names:
        q = _read(n, files, handles, quantized_ok=True)
        if q.dtype != np.dtype(dtype) or q.ndim != 2:
            raise CheckpointError(f"tensor {n} in {files[n].name} should be a 2-D "
                                  f"{dtype} weight; it is {q.dtype} {tuple(q.shape)}")
        try:
            scales.append(fp8.scale_2d(n, q.shape, _read(fp8.scale_name(n), files, handles)))
        except fp8_checkpoint.FormatError as e:
            raise CheckpointError(str(e)) from None
        qs.append(q)
    axes = quant.linear_axes(param_path)
    if axes is None:
        deq = [quant.numpy_dequantize(q, s, (q.shape[0] // s.shape[0], q.shape[1] // s.shape[1]))
               for q, s in zip(qs, scales)]
        return build(*deq) if build else deq[0]
    lead, in_axes = axes
    try:
        value = build(*qs)
    except ValueError:
        value = None
    if value is None or value.shape != want.shape:
        raise CheckpointError(
            f"tensor {names[0]} in {files[names[0]].name} has shape {qs[0].shape}, which "
            f"does not fit {'.'.join(param_path)} {tuple(want.shape)} of this config")
    scale_t = np.stack([s.T for s in scales]) if lead else scales[0].T
    scale = fp8_checkpoint.to_param_scale(scale_t, want.shape, lead, in_axes)
    if scale is None:
        raise CheckpointError(f"{fp8.scale_name(names[0])}: blocks of {fp8.block} do not split "
                              f"evenly over the axes of {'.'.join(param_path)} "
                              f"{tuple(want.shape)}")
    w = quant.check(quant.QArray(value, scale.astype(np.float32), None, fp8.scheme),
                    fp8.scale_name(names[0]))
    return w if lead else quant.to_k_last(w, in_axes)
