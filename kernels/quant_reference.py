"""Quantized matrix products in plain jnp: the references the kernels are checked against, and
the W8A8 paths themselves (XLA's FP8 dot, and its INT8 x INT8 -> INT32 dot).

Weights come as a [K, N] matrix `q` (float8_e4m3fn, int8, int4) with float32 `scale` [G, N]
(G = 1: per output channel; G > 1: one row per group of K // G input rows) and an optional
`zero` like `scale`, meaning w = (q - zero) * scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FP8_MAX = 448.0
INT8_MAX = 127.0


def dequantize_matrix(q, scale, zero=None):
    """[K, N] float32 weights."""
    g = q.shape[0] // scale.shape[0]
    w = q.astype(jnp.float32)
    if zero is not None:
        w = w - jnp.repeat(zero.astype(jnp.float32), g, axis=0)
    return w * jnp.repeat(scale, g, axis=0)


def w8a16_reference(x, q, scale, zero=None):
    """x [M, K] (bf16/f32) times the quantized weights -> [M, N] in x's dtype, with the kernel's
    math: each group's (q - zero) in x's dtype, products accumulated in float32, scaled per
    group."""
    m, k = x.shape
    groups, n = scale.shape
    w = q.astype(jnp.float32)
    if zero is not None:
        w = w - jnp.repeat(zero.astype(jnp.float32), k // groups, axis=0)
    # Values in x's dtype, products exact in float32 (what an MMA with float32 accumulation
    # does; XLA:CPU has no bf16 x bf16 -> f32 batched dot).
    w = w.astype(x.dtype).astype(jnp.float32).reshape(groups, k // groups, n)
    part = jnp.einsum("mgk,gkn->mgn", x.astype(jnp.float32).reshape(m, groups, k // groups), w,
                      precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(part * scale[None], axis=1).astype(x.dtype)


def _shape_arg(shape: tuple) -> tuple:
    """`reshape(a, b)` and `reshape((a, b))` alike, as arrays take them."""
    return shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows8:
    """An activation [..., K] already quantized per row for W8A8 products (`kernels.norm_quantize`
    makes it): the 8-bit values, their float32 row scales [..., 1], and the dtype the products
    come out in. `kernels.quant_matmul` and `kernels.w8a8_glu` take it where they take x."""
    q: jax.Array
    scale: jax.Array
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self):
        return self.q.ndim

    def reshape(self, *shape):
        """The rows of a new leading shape ([..., K] -> [M, K] and back); K stays last."""
        q = self.q.reshape(_shape_arg(shape))
        return Rows8(q, self.scale.reshape(*q.shape[:-1], 1), self.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Product:
    """A W8A8 product [..., N] before its scales: the 8-bit GEMM's raw output `p` (bf16 from FP8,
    int32 from INT8), its rows' scales [..., 1] (the input's) and its columns' [1, N] (the
    weight's). `value()` applies them as `w8a8_matmul` / `w8a8_int8_matmul` do; the norm after
    the product takes it whole and scales it in its own pass (`kernels.norm_quantize`)."""
    p: jax.Array
    row_scale: jax.Array
    col_scale: jax.Array
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.p.shape

    def value(self):
        return (self.p.astype(jnp.float32) * self.col_scale * self.row_scale).astype(self.dtype)

    def reshape(self, *shape):
        """New leading axes; N stays last."""
        p = self.p.reshape(_shape_arg(shape))
        if p.shape[-1] != self.p.shape[-1]:
            raise ValueError(f"a product [..., {self.p.shape[-1]}] keeps its last axis")
        return Product(p, self.row_scale.reshape(*p.shape[:-1], 1), self.col_scale, self.dtype)


def value(y):
    """A product's value: `Product.value()`, or y itself."""
    return y.value() if isinstance(y, Product) else y


def _row_scaled(x, qmax):
    """x in float32 divided by its rows' scales (amax / qmax, 1 for a zero row), and those
    scales [M, 1]."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    s = jnp.where(amax > 0, amax / qmax, 1.0)
    return x / s, s


def quantize_rows(x):
    """Dynamic per-token (row) FP8 quantization: (xq [M, K] e4m3, scale [M, 1] float32)."""
    xs, s = _row_scaled(x, FP8_MAX)
    return jnp.clip(xs, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), s


# XLA turns on cuBLASLt's FP8 "fast accumulation" for an FP8 dot at DEFAULT precision: Hopper's
# FP8 MMAs then keep their partial sums at about 14 bits of mantissa for the whole K instead of
# promoting them to float32 every few MMAs, and a K=4096 product drifts by ~2e-3 of its norm from
# the float32 product of the same FP8 inputs (H100, M=2048). HIGHEST turns it off; exact inputs
# then leave only float32 accumulation error. `fast=True` keeps it (timing the difference).
def w8a8_dot(xq, xs, q, scale, *, layout: str = "kn", fast: bool = False, out=jnp.float32):
    """float32 [M, N]: xq [M, K] float8_e4m3fn with row scales xs [M, 1] times q (float8_e4m3fn
    [K, N] for layout "kn", [N, K] for "nk", where both operands run along K as cuBLASLt's FP8
    GEMM reads them) with scale [G, N], on XLA's FP8 dot; with one scale a channel the GEMM
    writes its product in `out` before the scales."""
    precision = None if fast else jax.lax.Precision.HIGHEST
    m, k = xq.shape
    groups, n = scale.shape
    if groups == 1:
        y = dot8(xq, q, layout=layout, out=out, precision=precision)
        y = y.astype(jnp.float32) * scale
    else:  # one FP8 product per group of K, batched, then the scaled sum
        qg = (q.reshape(n, groups, k // groups) if layout == "nk"
              else q.reshape(groups, k // groups, n))
        part = jax.lax.dot_general(xq.reshape(m, groups, k // groups).transpose(1, 0, 2), qg,
                                   (((2,), (2 if layout == "nk" else 1,)),
                                    ((0,), (1 if layout == "nk" else 0,))),
                                   precision=precision,
                                   preferred_element_type=jnp.float32)  # [G, M, N]
        y = jnp.sum(part * scale[:, None, :], axis=0)
    return y * xs


def w8a8_matmul(x, q, scale, *, layout: str = "kn", fast: bool = False, unscaled=False):
    """FP8 x FP8 on the tensor cores: x quantized per row (or given as `Rows8`), XLA's FP8 dot
    (cuBLASLt on Hopper) accumulating in float32 and writing its product in x's dtype, both
    scales applied after (or, `unscaled`, left to the caller as a `Product`: one scale a
    channel only). q must be float8_e4m3fn. (A bf16 product runs 1.33-1.50x bf16 for an 8B
    layer's products, a float32 one 1.24-1.44x: `benchmarks/w8a8_compile.py`.)"""
    xq, xs = (x.q, x.scale) if isinstance(x, Rows8) else quantize_rows(x)
    if unscaled and scale.shape[0] == 1:
        precision = None if fast else jax.lax.Precision.HIGHEST
        return Product(dot8(xq, q, layout=layout, out=x.dtype, precision=precision), xs, scale,
                       x.dtype)
    return w8a8_dot(xq, xs, q, scale, layout=layout, fast=fast, out=x.dtype).astype(x.dtype)


def w8a8_reference(x, q, scale, *, layout: str = "kn", product=jnp.float32):
    """W8A8 with the same quantization, in float32; `product` bf16 rounds the unscaled product
    to bf16 first, as `w8a8_dot(out=jnp.bfloat16)` has the GEMM write it."""
    xq, xs = quantize_rows(x)
    qm, hi = (q.T if layout == "nk" else q), jax.lax.Precision.HIGHEST
    if scale.shape[0] > 1:  # groups: the dequantized weight
        y = jnp.dot(xq.astype(jnp.float32) * xs, dequantize_matrix(qm, scale), precision=hi)
        return y.astype(x.dtype)
    y = jnp.dot(xq.astype(jnp.float32), qm.astype(jnp.float32), precision=hi)
    return (y.astype(product).astype(jnp.float32) * scale * xs).astype(x.dtype)


def quantize_rows_int8(x):
    """Dynamic per-token (row) symmetric INT8: (xq [M, K] int8, scale [M, 1] float32)."""
    xs, s = _row_scaled(x, INT8_MAX)
    return jnp.clip(jnp.round(xs), -INT8_MAX, INT8_MAX).astype(jnp.int8), s


def quantize_rows_as(x, out):
    """`quantize_rows` (out float8_e4m3fn) or `quantize_rows_int8` (out int8)."""
    return (quantize_rows_int8 if jnp.dtype(out) == jnp.int8 else quantize_rows)(x)


def w8a8_int8_matmul(x, q, scale, *, layout: str = "kn", unscaled=False):
    """INT8 x INT8 on the tensor cores (SmoothQuant W8A8): x quantized per row (or given as
    `Rows8`), XLA's integer dot accumulating exactly in int32, then the row and channel scales
    (or, `unscaled`, a `Product`). q int8 with per-channel scale [1, N] (the INT8 GEMM has no
    groups along K)."""
    if scale.shape[0] != 1:
        raise ValueError(f"INT8 W8A8 takes one scale per output channel, not {scale.shape[0]} "
                         "groups along K")
    xq, xs = (x.q, x.scale) if isinstance(x, Rows8) else quantize_rows_int8(x)
    acc = dot8(xq, q, layout=layout, precision=None)
    if unscaled:
        return Product(acc, xs, scale, x.dtype)
    return (acc.astype(jnp.float32) * scale * xs).astype(x.dtype)


def dot8(xq, q, *, layout: str = "kn", out=jnp.int32, precision=jax.lax.Precision.HIGHEST):
    """The unscaled product of 8-bit operands (float8_e4m3fn or int8) xq [M, K] and q ([K, N],
    or [N, K] for layout "nk") on XLA's 8-bit dot, written in `out`."""
    kq = 1 if layout == "nk" else 0  # q's K axis
    return jax.lax.dot_general(xq, q, (((1,), (kq,)), ((), ())), precision=precision,
                               preferred_element_type=out)


def w8a8_int8_reference(x, q, scale, *, layout: str = "kn"):
    """The same quantization, dequantized to float32 first."""
    xq, xs = quantize_rows_int8(x)
    w = dequantize_matrix(q.T if layout == "nk" else q, scale)
    y = jnp.dot(xq.astype(jnp.float32) * xs, w, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
