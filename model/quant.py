"""Quantized weights: the one layout every scheme and checkpoint format converts into.

A quantized weight is a `QArray`, a pytree node that stands in the params exactly where the plain
weight stood (`params["layers_0"]["attn"]["wq"]`), and `linear` / `dequantize` are what the model
calls on it. The layout:

  q       the stored values, in the weight's own shape and axis order ([in..., out...], or
          [experts, in, out]), so `q` shards exactly like the plain weight:
            "fp8"  float8_e4m3fn
            "int8" int8
            "int4" jnp.int4 (signed) or jnp.uint4 (with `zero`); XLA packs two a byte
  scale   float32, of the weight's rank: along axis i it has q.shape[i] / block[i] entries, one
          per block of `block[i]` consecutive elements (blocks tile q evenly). So
            per output channel   block = full size on the contraction axes, 1 elsewhere
                                 (wq [d, h, hd]: block (d, 1, 1), scale [1, h, hd])
            per group of g       block g on the (last) contraction axis, 1 on the outputs
                                 (w_down [f, d], g = 128: block (128, 1), scale [f/128, d])
            block-wise [bk, bn]  block (bk, bn) (DeepSeek-V3 / Qwen3-FP8 checkpoints)
            per tensor           block = the shape, scale all ones in rank
          A scale axis of size 1 cannot be split over a mesh axis, so it is copied; other axes
          shard like q's (`shardings_for`, `spec_for`). Blocks must tile q's axes evenly.
  zero    optional, the shape of `scale`, in q's units (asymmetric int schemes)
  scheme  static: "fp8", "int8" or "int4"
  k_last  static: 0, or the number of contraction axes stored last. FP8 weights of the dense
          projections are stored [out..., in...] (`to_k_last`), so their matrix is [N, K]: the
          W8A16 kernel then reads rows of contiguous K (1.2-1.45x a [K, N] read at one row on the
          H100) and cuBLASLt's FP8 GEMM takes both operands along K, as Hopper's FP8 MMA wants.
          q, scale and zero are all stored so; `shape` is still the weight's own.
  block   not stored: q.shape // scale.shape (in stored order), so it also holds for one
          device's shard

  dequantize(w) = (q - zero) * scale, each scale/zero entry repeated over its block.

`linear(x, w, in_axes)` contracts x's last `in_axes` axes with w's first ones (the model's
projections) and `matrix(w, in_axes)` views a QArray as the [K, N] (or [E, K, N]) matrix the
kernels take: the blocks of the flattened axes must stay rectangular (an axis with block 1
followed by whole or evenly-blocked axes), which every layout above satisfies.
The kernels see plain arrays only: `kernels.quant_matmul(x [M, K], q [K, N], scale [G, N],
zero)` (G = K / block_k; it picks W8A16 or W8A8, `kernels/__init__.py`) and, for stacked
experts, `kernels.grouped_mlp` with (q, scale [E, G, N]) pairs, or packed integer experts as
`kernels.grouped_int.IntExperts` (`grouped_operand`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCHEMES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int4}

# The values `LLM(..., quantization=)` / `--quantization` accept; None = weights as loaded.
QUANTIZATIONS = ("fp8", "w4a16", "w8a16")  # the integer ones: model/quant_int.py


def check_quantization(value):
    """None or one of QUANTIZATIONS, else a ValueError naming the valid choices."""
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization {value!r} is not one of {', '.join(QUANTIZATIONS)} "
                         "(or None for the checkpoint's own weights)")
    return value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    scheme: str = dataclasses.field(default="fp8", metadata=dict(static=True))
    k_last: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def block(self) -> tuple:
        """Elements per scale entry along each axis. Derived from the shapes, so it also holds
        for a shard inside `shard_map` (a split contraction axis has smaller blocks there)."""
        return tuple(a // max(b, 1) for a, b in zip(self.q.shape, self.scale.shape))

    @property
    def shape(self):
        """The weight's own shape, [in..., out...], however it is stored."""
        n = self.q.ndim - self.k_last
        return self.q.shape[n:] + self.q.shape[:n] if self.k_last else self.q.shape

    def logical(self, a):
        """An array in stored order (q's, or a scale's) in the weight's own axis order."""
        if not self.k_last:
            return a
        n = a.ndim - self.k_last
        return jnp.transpose(a, tuple(range(n, a.ndim)) + tuple(range(n)))

    @property
    def ndim(self):
        return self.q.ndim

    @property
    def nbytes(self) -> int:
        return sum(array_nbytes(a) for a in (self.q, self.scale, self.zero) if a is not None)


def array_nbytes(a) -> int:
    """An array's bytes in memory: 4-bit types hold two values a byte (JAX's `nbytes` counts a
    byte each)."""
    return int(a.size) * a.dtype.itemsize // (2 if a.dtype in (jnp.int4, jnp.uint4) else 1)


def is_quantized(w) -> bool:
    return isinstance(w, QArray)


def is_packed(w) -> bool:
    """A layout that multiplies itself (`quant_int.PackedInt`): `linear` hands it the call."""
    return hasattr(w, "linear")


def path_keys(path) -> tuple:
    """A pytree path as its dict keys, e.g. ("layers_0", "attn", "wq")."""
    return tuple(getattr(k, "key", k) for k in path)


def check(w: QArray, name: str = "weight") -> QArray:
    """Shapes and dtypes as the layout says, or a ValueError naming `name`."""
    if w.scheme not in SCHEMES:
        raise ValueError(f"{name}: scheme {w.scheme!r} is not one of {sorted(SCHEMES)}")
    if w.scale.dtype != jnp.float32:
        raise ValueError(f"{name}: scale has dtype {w.scale.dtype}, not float32")
    for part in ("scale", "zero"):
        a = getattr(w, part)
        if a is not None and (a.ndim != w.q.ndim or any(
                n < 1 or s % n for s, n in zip(w.q.shape, a.shape))):
            raise ValueError(f"{name}: {part} has shape {tuple(a.shape)}, which does not tile "
                             f"the values' shape {tuple(w.q.shape)} into blocks")
    if w.zero is not None and w.zero.shape != w.scale.shape:
        raise ValueError(f"{name}: zero has shape {tuple(w.zero.shape)}, scale "
                         f"{tuple(w.scale.shape)}")
    return w


def per_channel_block(shape, contract_axes) -> tuple:
    return tuple(s if i in contract_axes else 1 for i, s in enumerate(shape))


def _expand(a, block):
    for axis, b in enumerate(block):
        if b > 1 and a.shape[axis] > 1:
            a = jnp.repeat(a, b, axis=axis)
    return a


def dequantize(w, dtype=jnp.float32):
    """The plain weight a QArray stands for (a plain array passes through, cast)."""
    if not is_quantized(w):
        return w.astype(dtype)
    x = w.q.astype(jnp.float32)
    if w.zero is not None:
        x = x - _expand(w.zero.astype(jnp.float32), w.block)
    return w.logical(x * _expand(w.scale, w.block)).astype(dtype)


def to_k_last(w: QArray, in_axes: int) -> QArray:
    """A QArray of a weight [in..., out...] stored [out..., in...] (see `k_last`). Weights
    with leading (expert) axes stay as they are: the grouped kernels read [E, K, N]."""
    if w.k_last:
        return w
    perm = tuple(range(in_axes, w.q.ndim)) + tuple(range(in_axes))
    xp = np if isinstance(w.q, np.ndarray) else jnp
    t = lambda a: None if a is None else xp.transpose(a, perm)
    return QArray(t(w.q), t(w.scale), t(w.zero), w.scheme, in_axes)


def quantize_fp8(weight, contract_axes=(0,), block=None) -> QArray:
    """float8_e4m3fn values with float32 scales: per output channel (amax over
    `contract_axes`) by default, or per `block` (one size per axis). Runs under jit."""
    w = jnp.asarray(weight).astype(jnp.float32)
    block = tuple(block) if block is not None else per_channel_block(w.shape, contract_axes)
    blocked = w.reshape([n for s, b in zip(w.shape, block) for n in (s // b, b)])
    amax = jnp.max(jnp.abs(blocked), axis=tuple(range(1, blocked.ndim, 2)))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(w / _expand(scale, block), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return QArray(q, scale, None, "fp8")


def quantize_int8(weight, contract_axes=(0,)) -> QArray:
    """Symmetric int8 values with float32 per-output-channel scales (amax / 127 over
    `contract_axes`): the weights of SmoothQuant-style W8A8. Runs under jit."""
    w = jnp.asarray(weight).astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=tuple(contract_axes), keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    return QArray(jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale, None,
                  "int8")


def _flat_block(shape, block) -> int:
    """Block size along the row-major flattening of axes `shape`: leading axes with block 1,
    then one blocked axis, then whole axes. Anything else is a ValueError."""
    first = next((i for i, b in enumerate(block) if b != 1), len(block) - 1)
    if any(b != s for s, b in zip(shape[first + 1:], block[first + 1:])):
        raise ValueError(f"blocks {block} of axes {shape} do not flatten to one block size")
    return block[first] * math.prod(shape[first + 1:])


def matrix(w: QArray, in_axes: int = 1, lead: int = 0) -> QArray:
    """A QArray [lead..., in..., out...] viewed as [lead..., K, N] (a reshape, no copy); one
    stored k_last as [N, K] (k_last 1)."""
    shape, block = w.q.shape, w.block
    if w.k_last:
        if lead or in_axes != w.k_last:
            raise ValueError(f"a weight stored with {w.k_last} contraction axes last is read "
                             f"with {in_axes} and {lead} leading axes")
        n_out = w.q.ndim - in_axes
        out_s, in_s = shape[:n_out], shape[n_out:]
        kn = (_flat_block(out_s, block[:n_out]), _flat_block(in_s, block[n_out:]))
        new, block = (math.prod(out_s), math.prod(in_s)), kn
    else:
        lead_s, in_s, out_s = shape[:lead], shape[lead:lead + in_axes], shape[lead + in_axes:]
        bk = _flat_block(in_s, block[lead:lead + in_axes])
        bn = _flat_block(out_s, block[lead + in_axes:])
        new = lead_s + (math.prod(in_s), math.prod(out_s))
        block = block[:lead] + (bk, bn)
    sshape = tuple(s // b for s, b in zip(new, block))
    reshape = lambda a: None if a is None else a.reshape(sshape)
    return QArray(w.q.reshape(new), reshape(w.scale), reshape(w.zero), w.scheme,
                  1 if w.k_last else 0)


def _per_column(a, n):
    """Scales (or zeros) [..., K / bk, N / bn] of a [..., K, N] matrix as the kernels take
    them: [..., K / bk, N]."""
    if a is None:
        return None
    a = _expand(a, (1,) * (a.ndim - 1) + (n // a.shape[-1],))
    return jnp.broadcast_to(a, a.shape[:-1] + (n,))


def linear(x, w, in_axes: int = 1, unscaled=False, **kw):
    """x [..., in...] times w [in..., out...] -> [..., out...] in x's dtype: a plain matmul,
    or for a QArray the quantized matmul `kernels.quant_matmul` picks (W8A16 / W8A8). x may
    come with its rows quantized (`Rows8`, see `rows8_for`); `unscaled`: a W8A8 product may
    come back before its scales (`Product`, one output axis only), for the norm after it."""
    if is_packed(w):
        return w.linear(x, in_axes)
    in_shape, out_shape = w.shape[:in_axes], w.shape[in_axes:]
    lead = x.shape[:x.ndim - in_axes]
    x2 = x.reshape(-1, math.prod(in_shape))
    if not is_quantized(w):
        y = kernels.matmul(x2, w.reshape(x2.shape[1], -1))
    else:
        q, scale, zero, layout = operands(w, in_axes)
        unscaled = unscaled and len(out_shape) == 1
        y = kernels.quant_matmul(x2, q, scale, zero, layout=layout, unscaled=unscaled, **kw)
    return y.reshape(*lead, *out_shape)


def operands(w: QArray, in_axes: int):
    """(q, scale [G, N], zero, layout) of a QArray as `kernels.quant_matmul` takes them."""
    m = matrix(w, in_axes)
    n = m.q.shape[0] if m.k_last else m.q.shape[1]
    kn = lambda a: a.T if m.k_last and a is not None else a  # scales as [K / bk, N / bn]
    return (m.q, _per_column(kn(m.scale), n), _per_column(kn(m.zero), n),
            "nk" if m.k_last else "kn")


def rows8_for(x, *weights):
    """The 8-bit dtype every one of `weights` (linear weights taking x [..., K] on their first
    axis) quantizes x's rows to for its W8A8 product (`kernels.w8a8_rows`), or None: then the
    norm before them can hand them x quantized (`Rows8`), made in its own pass."""
    if not weights or not all(is_quantized(w) for w in weights):
        return None
    rows = jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), x.shape[-1]), x.dtype)
    kinds = {kernels.w8a8_rows(rows, q, scale, zero, layout=layout)
             for q, scale, zero, layout in (operands(w, 1) for w in weights)}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def swiglu_w8a8(x, w_gate_up, w_down, **kw):
    """silu(gate) * up times w_down, for a fused gate/up weight [d, 2, f], as one
    `kernels.w8a8_glu` call where both weights take W8A8 there; None otherwise (the caller
    then multiplies as usual). `unscaled` as `linear`'s."""
    if not (is_quantized(w_gate_up) and is_quantized(w_down)) or w_gate_up.ndim != 3:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    y = kernels.w8a8_glu(x2, operands(w_gate_up, 1), operands(w_down, 1), **kw)
    return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])


def grouped_operand(w):
    """Stacked experts [E, K, N] as `kernels.grouped_mlp` takes them: a QArray as the (values,
    float32 scales [E, G, N]) pair (G = 1: per output channel), packed integer experts
    (`quant_int.PackedInt`) as `kernels.grouped_int.IntExperts`, a plain array as itself."""
    if is_packed(w):
        return w.grouped_operand()
    if not is_quantized(w):
        return w
    if w.zero is not None:
        raise NotImplementedError(f"grouped experts with zero points ({w.scheme})")
    m = matrix(w, in_axes=1, lead=1)
    return m.q, _per_column(m.scale, m.q.shape[-1])


# -- which params are quantized, and over which axes ---------------------------------------------
# name -> (leading batch axes, contraction axes) of the linear weights quantize-on-load converts;
# embeddings, norms, biases, the router and the LM head stay in the model dtype.
LINEAR_WEIGHTS = {
    ("attn", "wq"): (0, 1), ("attn", "wk"): (0, 1), ("attn", "wv"): (0, 1),
    ("attn", "wo"): (0, 2), ("attn", "wqkv"): (0, 1),  # fused: model/fuse.py
    ("mlp", "w_gate"): (0, 1), ("mlp", "w_up"): (0, 1), ("mlp", "w_down"): (0, 1),
    ("mlp", "w_gate_up"): (0, 1),
    ("moe", "w_gate"): (1, 1), ("moe", "w_up"): (1, 1), ("moe", "w_down"): (1, 1),
}


def linear_axes(param_path: tuple):
    """(lead, in_axes) of a linear weight's param path, or None for every other param."""
    return LINEAR_WEIGHTS.get(tuple(param_path[-2:]))


def all_quantized(weights) -> bool:
    """Whether there are weights and each is quantized (a QArray or a packed layout)."""
    return bool(weights) and all(is_quantized(w) or is_packed(w) for w in weights)


def all_linear_quantized(params) -> bool:
    """Whether every linear weight is a quantized one (a QArray, or a layout that multiplies
    itself), so that no projection is XLA's own product."""
    weight = lambda a: is_quantized(a) or is_packed(a)
    found = [weight(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
        params, is_leaf=weight) if linear_axes(path_keys(path)) is not None]
    return bool(found) and all(found)


# -- placement -------------------------------------------------------------------------------------
def _scale_spec(spec, shape, axis_size):
    """The weight's PartitionSpec for an array of `shape` (scale or zero): axes whose size does
    not divide their mesh axes (size-1 scale axes) are copied instead."""
    from jax.sharding import PartitionSpec as P
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return P(*(a if a is not None and s % axis_size(a) == 0 else None
               for a, s in zip(spec, shape)))


def spec_for(w, spec, axis_size):
    """For shard_map/jit specs: a QArray of PartitionSpecs for a QArray (q as the weight, its
    scale and zero as `_scale_spec`), `spec` itself for a plain array. `axis_size(mesh_axis)`
    gives a mesh axis' (or tuple of axes') size."""
    if not is_quantized(w):
        return spec
    if w.k_last:  # the weight's spec in stored order
        from jax.sharding import PartitionSpec as P
        full = tuple(spec) + (None,) * (w.q.ndim - len(spec))
        spec = P(*(full[w.k_last:] + full[:w.k_last]))
    other = lambda a: None if a is None else _scale_spec(spec, a.shape, axis_size)
    return QArray(spec, other(w.scale), other(w.zero), w.scheme, w.k_last)


def _mesh_axis_size(mesh):
    def size(a):
        names = a if isinstance(a, tuple) else (a,)
        return math.prod(int(mesh.shape[n]) for n in names)
    return size


def sharding_for(w, sharding):
    """The sharding(s) a (possibly quantized) weight takes, given the plain weight's."""
    from jax.sharding import NamedSharding
    if not is_quantized(w) or not isinstance(sharding, NamedSharding):
        return sharding
    specs = spec_for(w, sharding.spec, _mesh_axis_size(sharding.mesh))
    named = lambda s: None if s is None else NamedSharding(sharding.mesh, s)
    return QArray(named(specs.q), named(specs.scale), named(specs.zero), w.scheme, w.k_last)


def shardings_for(params, shardings):
    """The plain params' shardings pytree expanded to match `params`, where QArrays stand."""
    return jax.tree.map(sharding_for, params, shardings, is_leaf=is_quantized)


def quantize_params(params, scheme: str = "fp8"):
    """Every linear weight of a params pytree as a QArray (tests, benchmarks, random models).
    The loader quantizes tensor by tensor instead (`model.loader`); `quant_int.quantize_params`
    takes every mode. "int8" (per-channel round-to-nearest INT8, W8A8 without smoothing) is for
    benchmarks; calibrated INT8 comes from `pallasite quantize --method smoothquant`."""
    if scheme is None:
        return params
    if scheme not in ("fp8", "int8"):
        check_quantization(scheme)
        raise ValueError(f"quantize_params takes 'fp8'; {scheme!r} is quant_int.quantize_params'")

    def one(path, leaf):
        axes = linear_axes(path_keys(path))
        return leaf if axes is None else _jit_quantize(leaf, axes, scheme)
    return jax.tree_util.tree_map_with_path(one, params)


def quantize_linear(weight, axes, scheme: str = "fp8") -> QArray:
    """FP8 (or "int8") of a linear weight with (lead, in_axes) `axes`, per output channel, in
    the order the kernels read (`to_k_last` where there are no leading axes)."""
    lead, in_axes = axes
    quantize = quantize_int8 if scheme == "int8" else quantize_fp8
    w = quantize(weight, tuple(range(lead, lead + in_axes)))
    return w if lead else to_k_last(w, in_axes)


_jit_quantize = jax.jit(quantize_linear, static_argnums=(1, 2))


def weight_bytes(params) -> int:
    """Bytes the params take (QArrays counted as stored)."""
    return sum(x.nbytes if is_quantized(x) else int(x.size) * x.dtype.itemsize
               for x in jax.tree.leaves(params, is_leaf=is_quantized))


def numpy_dequantize(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """The plain numpy dequantization tests compare against."""
    x = q.astype(np.float32)
    for axis, b in enumerate(block):
        scale = np.repeat(scale, b, axis=axis) if scale.shape[axis] > 1 else scale
    return x * scale
