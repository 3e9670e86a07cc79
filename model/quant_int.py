"""Integer weight-only quantization (W4A16, W8A16): the packed layout the INT4/INT8 kernel
reads, round-to-nearest quantization of float weights into it, and reading the published
integer checkpoint formats (`int_formats.py`) into it at load.

`PackedInt` stands in the params where the plain weight stood, like `quant.QArray`, and
`quant.linear` hands it the call. Unlike a QArray its values are not in the weight's shape:
they are repacked once at load into the kernel's tiles (`kernels/int_matmul.py`), as Marlin
repacks, so the weight is the [K, N] matrix of the flattened input and output axes:

  words   int32 [K_pad * bits / 32, N], 32 / bits codes a word in the kernel's bit planes
  scale   float32 [K_pad / group_size, N]
  zero    bfloat16 [K_pad / group_size, N] (unsigned code of 0), None: 2**(bits - 1)
  perm    int32 [K] or None: act order, stored row i is input row perm[i]
  shape, in_axes, bits, group_size   static

Placing a PackedInt on a mesh of several devices is not supported yet (its rows are tiles,
not the weight's axes).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..kernels import w4a16_matmul as im
from .errors import CheckpointError
from .int_formats import IntLinear

# Quantize-on-load modes of float checkpoints: (bits, group size).
MODES = {"w4a16": (4, 128), "w8a16": (8, -1)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedInt:
    words: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    perm: jax.Array | None
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    in_axes: int = dataclasses.field(default=1, metadata=dict(static=True))
    bits: int = dataclasses.field(default=4, metadata=dict(static=True))
    group_size: int = dataclasses.field(default=128, metadata=dict(static=True))

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize
                   for a in (self.words, self.scale, self.zero, self.perm) if a is not None)

    def linear(self, x, in_axes: int):
        """x [..., in...] times this weight -> [..., out...] in x's dtype."""
        if in_axes != self.in_axes:
            raise ValueError(f"packed weight {self.shape} takes {self.in_axes} input axes, "
                             f"called with {in_axes}")
        k = math.prod(self.shape[:in_axes])
        lead = x.shape[:x.ndim - in_axes]
        y = kernels.int_matmul(x.reshape(-1, k), self.words, self.scale, self.zero, self.perm,
                               bits=self.bits, group_size=self.group_size)
        return y.reshape(*lead, *self.shape[in_axes:])

    def dequantize(self, dtype=jnp.float32):
        """The plain weight in its own shape (tests, reference)."""
        k = math.prod(self.shape[:self.in_axes])
        w = im.dequantize(self.words, self.scale, self.zero, bits=self.bits,
                          group_size=self.group_size, k=k)
        if self.perm is not None:
            w = w[jnp.argsort(self.perm)]
        return w.reshape(self.shape).astype(dtype)


def pack_linear(lin: IntLinear, shape: tuple, in_axes: int) -> PackedInt:
    """An IntLinear ([K, N] codes) as the kernel's packed arrays, for a param of `shape`."""
    k, n = math.prod(shape[:in_axes]), math.prod(shape[in_axes:])
    if lin.codes.shape != (k, n):
        raise ValueError(f"quantized weight of shape {lin.codes.shape} does not fit a param "
                         f"{shape} ([{k}, {n}])")
    words, scale, zero, g = im.pack_weight(lin.codes, lin.scale, lin.zero, bits=lin.bits,
                                           group_size=lin.group_size)
    perm = None if lin.perm is None else jnp.asarray(lin.perm, jnp.int32)
    return PackedInt(jnp.asarray(words), jnp.asarray(scale), zero, perm, tuple(shape), in_axes,
                     lin.bits, g)


def quantize_rtn(w, *, bits: int = 4, group_size: int = 128, symmetric: bool = True) -> IntLinear:
    """Round-to-nearest: w [K, N] -> codes with a scale (and zero) per group of `group_size`
    rows (-1: per column). Symmetric: scale = max|w| / (2**(bits-1) - 1), zero 2**(bits-1);
    asymmetric: the group's [min, max] (with 0) mapped onto [0, 2**bits - 1]."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    g = k if group_size in (-1, None) or group_size >= k else group_size
    if k % g:
        raise ValueError(f"quantize: K={k} is not a multiple of group_size={g}")
    wg = w.reshape(k // g, g, n)
    top = 2 ** bits - 1
    if symmetric:
        scale = np.abs(wg).max(axis=1) / (2 ** (bits - 1) - 1)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        zero = np.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
        scale = np.where(hi > lo, (hi - lo) / top, 1.0).astype(np.float32)
        zero = np.clip(np.round(-lo / scale), 0, top)
    codes = np.clip(np.round(wg / scale[:, None]) + zero[:, None], 0, top)
    return IntLinear(codes.reshape(k, n).astype(np.uint8), scale,
                     None if symmetric else zero.astype(np.float32), bits, g)


def quantize_weight(w, in_axes: int, mode: str) -> PackedInt:
    """One float linear weight (param shape, `in_axes` input axes) quantized RTN, packed."""
    bits, group = MODES[mode]
    shape = tuple(w.shape)
    k = math.prod(shape[:in_axes])
    if group != -1 and k % group:
        group = -1  # a K that groups do not tile takes one scale per output channel
    lin = quantize_rtn(np.asarray(w, np.float32).reshape(k, -1), bits=bits, group_size=group)
    return pack_linear(lin, shape, in_axes)


def quantize_params(params, mode: str | None = "w4a16"):
    """Every dense linear weight of a params pytree quantized RTN and packed (random models,
    benchmarks, quantize-on-load). MoE experts stay as they are. Any `--quantization` value is
    taken: None passes the params through, "fp8" goes to `quant.quantize_params`."""
    from . import quant
    if quant.check_quantization(mode) in (None, "fp8"):
        return quant.quantize_params(params, mode)

    def one(path, leaf):
        keys = tuple(getattr(k, "key", k) for k in path)
        axes = quant.linear_axes(keys)
        if axes is None or axes[0] != 0:
            return leaf
        return quantize_weight(leaf, axes[1], mode)
    return jax.tree_util.tree_map_with_path(one, params)


# -- integer checkpoints ---------------------------------------------------------------------------
FORMAT_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                           "weight_g_idx"),
}


class IntCheckpoint:
    """Which params of a checkpoint folder are stored as integer-quantized linears, and how to
    read each into a PackedInt. `int_checkpoint` builds one (None for other checkpoints)."""

    def __init__(self, quant_cfg, config, sources, expected, files):
        from . import quant
        from .int_formats import CompressedTensorsConfig
        self.quant = quant_cfg
        method = "compressed-tensors" if isinstance(quant_cfg, CompressedTensorsConfig) \
            else quant_cfg.method
        suffixes = FORMAT_TENSORS[method]
        self.linears = {}  # param path -> (module, shape, in_axes, tensor names)
        for path, (names, _) in sources.items():
            axes = quant.linear_axes(path)
            if axes is None:
                continue
            modules = [n.removesuffix(".weight") for n in names]
            stored = [[f"{m}.{s}" for s in suffixes if f"{m}.{s}" in files] for m in modules]
            if not any(stored):
                continue  # kept in floating point (ignored / not converted)
            if axes[0] != 0:
                raise CheckpointError(f"{modules[0]}: integer-quantized experts ({method}) are "
                                      "not supported yet")
            self.linears[path] = (modules[0], tuple(_get(expected, path).shape), axes[1],
                                  stored[0])
        self.method = method

    def names(self) -> set:
        return {n for *_, names in self.linears.values() for n in names}

    def load(self, path, get) -> PackedInt:
        from .int_formats import read_linear
        module, shape, in_axes, names = self.linears[path]
        k, n = math.prod(shape[:in_axes]), math.prod(shape[in_axes:])
        lin = read_linear(self.quant, get, lambda name: name in names, module, (k, n))
        if lin is None:
            raise CheckpointError(f"{module} holds {names} but the quantization_config does not "
                                  "quantize it")
        return pack_linear(lin, shape, in_axes)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def int_checkpoint(path, config, sources, expected, files):
    """The IntCheckpoint of a folder whose config.json has an AWQ, GPTQ or compressed-tensors
    pack-quantized `quantization_config`; None otherwise."""
    import json
    from pathlib import Path
    from .int_formats import parse_quantization_config
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text()) if file.is_file() else {}
    quant_cfg = parse_quantization_config(raw.get("quantization_config"))
    if quant_cfg is None:
        return None
    return IntCheckpoint(quant_cfg, config, sources, expected, files)


def describe(params) -> str:
    """How a params pytree's linear weights are stored, e.g. "w4a16 g128", "fp8" or
    "w8a8 int8" ("" for plain weights): what ModelInfo reports."""
    from . import quant
    kinds = set()
    for leaf in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, PackedInt)
                                or quant.is_quantized(w)):
        if isinstance(leaf, PackedInt):
            k = math.prod(leaf.shape[:leaf.in_axes])
            kinds.add(f"w{leaf.bits}a16 " + ("channel" if leaf.group_size >= k
                                             else f"g{leaf.group_size}"))
        elif quant.is_quantized(leaf):  # "fp8", or "w8a8 int8" (SmoothQuant's checkpoints)
            kinds.add("w8a8 int8" if leaf.scheme == "int8" else leaf.scheme)
    return ", ".join(sorted(kinds))
