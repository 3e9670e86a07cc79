"""Integer weight-only quantization (W4A16, W8A16): the packed layout the INT4/INT8 kernel
reads, round-to-nearest quantization of float weights into it, and reading the published
integer checkpoint formats (`int_formats.py`) into it at load.

`PackedInt` stands in the params where the plain weight stood, like `quant.QArray`, and
`quant.linear` hands it the call. Unlike a QArray its values are not in the weight's shape:
they are repacked once at load into the kernel's tiles (`kernels/w4a16_matmul.py`), as Marlin
repacks, so the weight is the [K, N] matrix of the flattened input and output axes:

  words   int32 [K_pad * bits / 32, N], 32 / bits codes a word in the kernel's bit planes
  scale   float32 [K_pad / group_size, N]
  zero    bfloat16 [K_pad / group_size, N] (unsigned code of 0), None: 2**(bits - 1)
  perm    int32 [K] or None: act order, stored row i is input row perm[i]
  shape, in_axes, bits, group_size, lead   static

Stacked MoE experts ([E, in, out], `lead` 1) hold one such matrix an expert, stacked on a
leading axis (words [E, K_pad * bits / 32, N], scale and zero [E, groups, N], perm [E, K]):
they do not multiply through `linear` but through the grouped kernel
(`kernels/grouped_int.py`), which takes them as `grouped_operand()` gives them.

Placing a PackedInt on a mesh of several devices is not supported yet (its rows are tiles,
not the weight's axes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..kernels import grouped_int as gi
from ..kernels import w4a16_matmul as im
from ..kernels import w4a16_mgpu as mg
from .errors import CheckpointError
from .int_formats import IntLinear
from .quant import array_nbytes

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
    lead: int = dataclasses.field(default=0, metadata=dict(static=True))  # 1: stacked experts
    # kernels.INT_LAYOUTS: "kn" words [K_pad / per, N]; "nk16" the Hopper kernel's [N, K_pad / per];
    # "nk_i4" int4 [N, K_pad] (symmetric INT4)
    layout: str = dataclasses.field(default="kn", metadata=dict(static=True))

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def k(self) -> int:
        """Input rows of one matrix (an expert's, for stacked experts)."""
        return math.prod(self.shape[self.lead:self.lead + self.in_axes])

    @property
    def nbytes(self) -> int:
        return sum(array_nbytes(a) for a in (self.words, self.scale, self.zero, self.perm)
                   if a is not None)

    def linear(self, x, in_axes: int):
        """x [..., in...] times this weight -> [..., out...] in x's dtype."""
        if self.lead:
            raise ValueError(f"packed experts {self.shape} multiply through the grouped kernel "
                             "(grouped_operand), not linear")
        if in_axes != self.in_axes:
            raise ValueError(f"packed weight {self.shape} takes {self.in_axes} input axes, "
                             f"called with {in_axes}")
        lead = x.shape[:x.ndim - in_axes]
        y = kernels.int_matmul(x.reshape(-1, self.k), self.words, self.scale, self.zero,
                               self.perm, bits=self.bits, group_size=self.group_size,
                               layout=self.layout)
        return y.reshape(*lead, *self.shape[in_axes:])

    def grouped_operand(self) -> gi.IntExperts:
        """Stacked experts as the operand `kernels.grouped_mlp` takes."""
        if not self.lead:
            raise ValueError(f"packed weight {self.shape} is not a stack of experts")
        return gi.IntExperts(self.words, self.scale, self.zero, self.perm, self.bits,
                             self.group_size)

    def dequantize(self, dtype=jnp.float32):
        """The plain weight in its own shape (tests, reference)."""
        if self.lead:
            w = gi.dequantize(self.grouped_operand(), self.k)
        else:
            codes = _codes(self.words, self.bits, self.k, self.layout)
            w = im.dequantize_codes(codes, self.scale, self.zero, bits=self.bits,
                                    group_size=self.group_size)
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


def pack_experts(lins: list, shape: tuple, in_axes: int, name: str = "experts") -> PackedInt:
    """One IntLinear an expert ([K, N] codes each) as stacked packed experts, for a param of
    `shape` [E, in..., out...]. The experts must share bits and group size; where some carry
    zero points (or an act-order permutation) and others do not, the others get the symmetric
    zero 2**(bits - 1) (the identity permutation)."""
    e, k, n = shape[0], math.prod(shape[1:1 + in_axes]), math.prod(shape[1 + in_axes:])
    if len(lins) != e:
        raise ValueError(f"{name}: {len(lins)} quantized experts for a param {shape}")
    first = lins[0]
    for i, lin in enumerate(lins):
        if lin.codes.shape != (k, n):
            raise ValueError(f"{name}: expert {i}'s quantized weight of shape "
                             f"{lin.codes.shape} does not fit a param {shape} ([{k}, {n}] an "
                             "expert)")
        if (lin.bits, lin.group_size) != (first.bits, first.group_size):
            raise ValueError(f"{name}: expert {i} has {lin.bits} bits in groups of "
                             f"{lin.group_size}, expert 0 {first.bits} in groups of "
                             f"{first.group_size}")
    any_zero = any(lin.zero is not None for lin in lins)
    zeros = [lin.zero if lin.zero is not None or not any_zero
             else np.full_like(lin.scale, 2 ** (lin.bits - 1)) for lin in lins]
    words, scale, zero, g = gi.pack_experts([lin.codes for lin in lins],
                                            [lin.scale for lin in lins], zeros,
                                            bits=first.bits, group_size=first.group_size)
    perm = None
    if any(lin.perm is not None for lin in lins):
        perm = jnp.asarray(np.stack([np.arange(k) if lin.perm is None else lin.perm
                                     for lin in lins]), jnp.int32)
    return PackedInt(words, scale, zero, perm, tuple(shape), in_axes, first.bits, g, lead=1)


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


def quantize_weight(w, in_axes: int, mode: str, lead: int = 0) -> PackedInt:
    """One float linear weight (param shape, `in_axes` input axes) quantized RTN, packed;
    with `lead` 1, stacked experts [E, in..., out...], each expert quantized on its own. Runs
    where the weight is (on the device for a loaded one): `quantize_rtn` and the kernel's
    packing in one program."""
    bits, group = MODES[mode]
    shape = tuple(w.shape)
    k = math.prod(shape[lead:lead + in_axes])
    if group == -1 or k % group:
        group = k  # a K that groups do not tile takes one scale per output channel
    fn = functools.partial(rtn_packed, bits=bits, group_size=group)
    w = jnp.asarray(w).reshape(*shape[:lead], k, -1)
    words, scale = jax.vmap(fn)(w) if lead else fn(w)
    k_pad = im.padded_k(k, bits)
    return PackedInt(words, scale, None, None, shape, in_axes, bits,
                     k_pad if group >= k else group, lead=lead)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def rtn_packed(w, *, bits: int, group_size: int):
    """Symmetric `quantize_rtn` of w [K, N] and `w4a16_matmul.pack_weight`'s layout in jnp:
    (int32 words, float32 scale padded to the packed K)."""
    k, n = w.shape
    half, k_pad = 2 ** (bits - 1), im.padded_k(k, bits)
    wg = w.astype(jnp.float32).reshape(k // group_size, group_size, n)
    scale = jnp.abs(wg).max(axis=1) / (half - 1)
    scale = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(wg / scale[:, None]) + half, 0, 2 * half - 1)
    return (im.pack(codes.astype(jnp.uint32).reshape(k, n), bits),
            im.pack_groups(scale, k_pad, k_pad if group_size >= k else group_size, 1.0,
                           jnp.float32))


def quantize_params(params, mode: str | None = "w4a16"):
    """Every linear weight of a params pytree quantized RTN and packed, MoE experts one by
    one into stacked packed experts (random models, benchmarks, quantize-on-load). Any
    `--quantization` value is taken: None passes the params through, "fp8" goes to
    `quant.quantize_params`."""
    from . import quant
    if quant.check_quantization(mode) in (None, "fp8"):
        return quant.quantize_params(params, mode)

    def one(path, leaf):
        keys = tuple(getattr(k, "key", k) for k in path)
        axes = quant.linear_axes(keys)
        if axes is None:
            return leaf
        return quantize_weight(leaf, axes[1], mode, lead=axes[0])
    return jax.tree_util.tree_map_with_path(one, params)


def for_kernels(params, layout: str | None = None):
    """Every packed linear weight (experts aside) of a params tree in `layout` (default: the
    one `kernels.int_layout()` reads fastest on this device), in place like `fuse.fuse_params`:
    each weight's old words go as its new ones are made. Returns `params`.
    By default every form the Hopper kernel can tile moves there (INT4 and INT8, with or without
    zero points or act-order, any group size): on the H100 it ran 8B layers 0.94-4.3x the Triton
    kernel's speed from 16 rows up (under 1.0x only INT8 channel-wise gate/up) and 0.85-1.66x at
    one row (`benchmarks/bench_w4a16_mgpu.py --quant-forms`). Symmetric INT4 in groups of whole
    128-row tiles goes on to int4 tiles ("nk_i4"): on the H200 the words took 1.26-1.77x their
    time at 2-16 rows on 8B layers, 1.11-1.24x at 64-256, and level at one row (`--forms
    i4,library_hopper`); PALLASITE_INT4_TILES=0 keeps the words."""
    def wanted(p: PackedInt) -> str:
        if layout is not None:
            return layout
        to = kernels.int_layout()
        if to == "nk16" and p.layout == "kn":
            kw, n = p.words.shape
            k_pad = kw * (32 // p.bits)
            if mg.supported(16, k_pad, n, bits=p.bits, group_size=p.group_size, block_n=64):
                return "kn"  # a shape the Hopper kernel cannot tile keeps the Triton kernel
            if (p.zero is None and os.environ.get("PALLASITE_INT4_TILES", "1") != "0"
                    and not mg.supported(16, k_pad, n, bits=p.bits, group_size=p.group_size,
                                         block_n=64, unpack="int4")):
                return "nk_i4"
        return to

    def walk(tree):
        for key, leaf in tree.items():
            if isinstance(leaf, dict):
                walk(leaf)
            elif isinstance(leaf, PackedInt) and not leaf.lead:
                to = wanted(leaf)
                if leaf.layout != to:
                    tree[key] = relayout(leaf, to)
    if isinstance(params, dict):
        walk(params)
    return params


def relayout(p: PackedInt, layout: str) -> PackedInt:
    if layout not in kernels.INT_LAYOUTS:
        raise ValueError(f"packed layout {layout!r} is not one of {kernels.INT_LAYOUTS}")
    words = _relayout(p.words, bits=p.bits, k=p.k, src=p.layout, dst=layout)
    return dataclasses.replace(p, words=words, layout=layout)


def _codes(words, bits: int, k: int, layout: str):
    """The int32 codes [K, N] of a packed weight in `layout`."""
    if layout == "nk_i4":
        return mg.unpack_i4(words, k)
    return im.unpack(words, bits, k) if layout == "kn" else mg.unpack_t(words, bits, k)


@functools.partial(jax.jit, static_argnames=("bits", "k", "src", "dst"))
def _relayout(words, *, bits: int, k: int, src: str, dst: str):
    codes = _codes(words, bits, k, src)
    if dst == "nk_i4":
        return mg.pack_i4(codes)
    return im.pack(codes, bits) if dst == "kn" else mg.pack_t(codes, bits)


# -- integer checkpoints ---------------------------------------------------------------------------
FORMAT_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                           "weight_g_idx"),
}


class IntCheckpoint:
    """Which params of a checkpoint folder are stored as integer-quantized linears, and how to
    read each into a PackedInt. `int_checkpoint` builds one (None for other checkpoints).
    MoE experts stored one module an expert (Mixtral's `experts.E.w1`, Qwen-MoE's
    `experts.E.gate_proj`) are read expert by expert into stacked packed experts."""

    def __init__(self, quant_cfg, config, sources, expected, files):
        from . import quant
        from .int_formats import CompressedTensorsConfig
        self.quant = quant_cfg
        method = "compressed-tensors" if isinstance(quant_cfg, CompressedTensorsConfig) \
            else quant_cfg.method
        suffixes = FORMAT_TENSORS[method]
        # param path -> (HF modules (one an expert for experts), shape, in_axes, tensor names)
        self.linears = {}
        for path, (names, _) in sources.items():
            axes = quant.linear_axes(path)
            if axes is None:
                continue
            modules = [n.removesuffix(".weight") for n in names]
            stored = [[f"{m}.{s}" for s in suffixes if f"{m}.{s}" in files] for m in modules]
            if not any(stored):
                continue  # kept in floating point (ignored / not converted)
            shape = tuple(_get(expected, path).shape)
            if axes[0] == 0:
                self.linears[path] = ([modules[0]], shape, axes[1], stored[0])
                continue
            if len(modules) != shape[0] or len(set(modules)) != len(modules):
                raise CheckpointError(f"{modules[0]}: integer-quantized experts ({method}) "
                                      "stored in one tensor for all experts are not supported; "
                                      "only one module an expert")
            bare = [m for m, st in zip(modules, stored) if not st]
            if bare:
                raise CheckpointError(f"{bare[0]} is stored in floating point while other "
                                      f"experts of {'.'.join(path)} are integer-quantized "
                                      f"({method}); all of a projection's experts must be")
            self.linears[path] = (modules, shape, axes[1], [n for st in stored for n in st])
        self.method = method

    def names(self) -> set:
        return {n for *_, names in self.linears.values() for n in names}

    def load(self, path, get) -> PackedInt:
        from . import quant
        from .int_formats import read_linear
        modules, shape, in_axes, names = self.linears[path]
        lead = quant.linear_axes(path)[0]
        k = math.prod(shape[lead:lead + in_axes])
        n = math.prod(shape[lead + in_axes:])
        held = set(names)
        has = lambda name: name in held
        lins = []
        for module in modules:
            lin = read_linear(self.quant, get, has, module, (k, n))
            if lin is None:
                held = [x for x in names if x.startswith(module + ".")]
                raise CheckpointError(f"{module} holds {held} but the quantization_config does "
                                      "not quantize it")
            lins.append(lin)
        if not lead:
            return pack_linear(lins[0], shape, in_axes)
        try:
            return pack_experts(lins, shape, in_axes, name=modules[0].rpartition(".experts.")[0]
                                + ".experts")
        except ValueError as e:
            raise CheckpointError(str(e)) from None


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
            kinds.add(f"w{leaf.bits}a16 " + ("channel" if leaf.group_size >= leaf.k
                                             else f"g{leaf.group_size}"))
        elif quant.is_quantized(leaf):  # "fp8", or "w8a8 int8" (SmoothQuant's checkpoints)
            kinds.add("w8a8 int8" if leaf.scheme == "int8" else leaf.scheme)
    return ", ".join(sorted(kinds))
