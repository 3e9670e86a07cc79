"""RMSNorm into an 8-bit product's input, in one pass: the residual stream in, the next W8A8
GEMM's row-quantized input out (Pallas, Triton backend).

x [M, D] is the residual stream; with `residual` [M, D] the kernel first adds it (the sublayer's
output) and also writes the sum, the stream the layer goes on with. The residual may come as a
W8A8 product before its scales (its raw bf16 or int32 GEMM output with `residual_scales`, the
rows' [M, 1] and the columns' [D]): the kernel scales it as `quant_reference.Product.value`
does, so the product's own scaling pass goes too. Row r is normalized
(x * rsqrt(mean(x^2) + eps) in float32, then times the norm's weight, rounded as the model's
`RMSNorm` rounds) and quantized per row as `quant_reference.quantize_rows` /
`quantize_rows_int8` would do it: (xq [M, D] float8_e4m3fn or int8, xs [M, 1] float32). Without
an 8-bit `out` it writes the norm itself in x's dtype, for products that take x as it is.

As XLA fusions the same is an add, the sum of squares, the normalization, the rows' maximum and
the conversion, each its own pass over the [M, D] activation (`profiling/profile_step.py
--cases p2k --quantization fp8`). Here one program holds a row in registers (pieces of up to
2048), so x and the residual are read once and only the sum and the 8-bit row are written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .quant_reference import FP8_MAX, INT8_MAX, Product, quantize_rows_as

EIGHT = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))


def piece(d: int) -> int:
    """The largest power of two (at most 2048) dividing D: Triton's blocks are powers of two."""
    return min(2048, d & -d)


def _normed(x32, r, w, dtype, plus_one):
    """The model's RMSNorm of one piece, given the row's rsqrt `r` (`model/layers.RMSNorm`):
    the normalized row rounded to the model dtype, then times the weight in that dtype."""
    if plus_one:
        return (x32 * r * (1.0 + w.astype(jnp.float32))).astype(dtype)
    return ((x32 * r).astype(dtype).astype(jnp.float32) * w.astype(jnp.float32)).astype(dtype)


def round_even(q):
    """To nearest, halves to even, as jnp.round (Triton has no rule for round): bf16 rows put
    exact halves in a few of every thousand int8 codes."""
    r = jnp.floor(q + 0.5)
    odd = r - 2.0 * jnp.floor(r * 0.5) != 0.0
    return jnp.where((r - q == 0.5) & odd, r - 1.0, r)


def store_rows(hs, q_ref, s_ref, size):
    """A row held as float32 pieces of `size`, quantized per row into q_ref's dtype (float8_e4m3fn
    or int8) and stored with its scale, as `quant_reference.quantize_rows_as` makes them. The
    division is XLA's: times the reciprocal (its simplifier's rewrite of a division by a
    broadcast), so exact halves of int8 codes land where XLA's do."""
    out = q_ref.dtype
    qmax = FP8_MAX if out == jnp.float8_e4m3fn else INT8_MAX
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(h)) for h in hs])
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    for c, h in enumerate(hs):
        q = jnp.clip(h * (1.0 / scale), -qmax, qmax)
        q_ref[0, pl.ds(c * size, size)] = (round_even(q) if out == jnp.int8 else q).astype(out)
    s_ref[0, 0] = scale


def _kernel(*refs, size, eps, plus_one, add, scaled, quantize):
    x_ref, *refs = refs
    res_ref, *refs = refs if add else (None, *refs)
    rs_ref, cs_ref, *refs = refs if scaled else (None, None, *refs)
    w_ref, q_ref, *refs = refs
    s_ref, *sum_ref = refs if quantize else (None, *refs)
    d, dtype = x_ref.shape[1], x_ref.dtype
    rows = []
    for c in range(d // size):  # the row's pieces stay in registers until its scales are known
        at = pl.ds(c * size, size)
        x = x_ref[0, at]
        if add:  # the residual sum in the stream's dtype, as `x + h` rounds it
            h = res_ref[0, at].astype(jnp.float32)
            if scaled:  # the product's scales, in `Product.value`'s order
                h = (h * cs_ref[at] * rs_ref[0, 0]).astype(dtype).astype(jnp.float32)
            x = (x.astype(jnp.float32) + h).astype(dtype)
            sum_ref[0][0, at] = x
        rows.append(x.astype(jnp.float32))
    r = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in rows) / d + eps)
    hs = [_normed(x, r, w_ref[pl.ds(c * size, size)], dtype, plus_one) for c, x in
          enumerate(rows)]
    if not quantize:  # the norm itself, in the stream's dtype
        for c, h in enumerate(hs):
            q_ref[0, pl.ds(c * size, size)] = h
        return
    store_rows([h.astype(jnp.float32) for h in hs], q_ref, s_ref, size)


def check(x, weight, residual=None, residual_scales=None, out=jnp.float8_e4m3fn):
    """A ValueError for operands the kernel does not take."""
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"norm_quantize takes x [M, D] and weight [D]; got {x.shape}, "
                         f"{weight.shape}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {residual.shape} is not x's shape {x.shape}")
    if residual_scales is not None and (residual is None or tuple(
            a.shape for a in residual_scales) != ((x.shape[0], 1), (x.shape[1],))):
        raise ValueError(f"residual_scales take a residual, rows [M, 1] and columns [D]; got "
                         f"{[a.shape for a in residual_scales or ()]} for x {x.shape}")
    if out is not None and jnp.dtype(out) not in EIGHT:
        raise ValueError(f"norm_quantize writes float8_e4m3fn or int8, not {out}")


# 16 warps a program, as `glu_quant` (a row of 4096 is 8 values a thread).
@functools.partial(jax.jit, static_argnames=("eps", "plus_one", "out", "num_warps", "interpret"))
def norm_quantize(x, weight, residual=None, residual_scales=None, *, eps, plus_one=False,
                  out=jnp.float8_e4m3fn, num_warps=16, interpret=False):
    """x [M, D] (+ residual [M, D], scaled by `residual_scales` (rows [M, 1], columns [D]) if
    given) -> (xq [M, D] in `out`, xs [M, 1] float32, the sum or None): RMSNorm(x + residual)
    quantized per row (float8_e4m3fn or int8). `out=None`: the norm itself in x's dtype, and
    None for xs (the add and the norm in one pass, for products that take x as it is)."""
    check(x, weight, residual, residual_scales, out)
    M, D = x.shape
    add, scaled, quantize = residual is not None, residual_scales is not None, out is not None
    row = lambda n: pl.BlockSpec((1, n), lambda r: (r, 0))
    whole = pl.BlockSpec((D,), lambda r: (0,))
    out_shape = [jax.ShapeDtypeStruct((M, D), out if quantize else x.dtype)] + [
        jax.ShapeDtypeStruct((M, 1), jnp.float32)] * quantize
    operands = [x] + [residual] * add + [a.astype(jnp.float32) for a in residual_scales or ()]
    result = pl.pallas_call(
        functools.partial(_kernel, size=piece(D), eps=eps, plus_one=plus_one, add=add,
                          scaled=scaled, quantize=quantize),
        grid=(M,),
        in_specs=[row(D)] + [row(D)] * add + [row(1), whole] * scaled + [whole],
        out_specs=[row(D)] + [row(1)] * quantize + [row(D)] * add,
        out_shape=out_shape + ([jax.ShapeDtypeStruct((M, D), x.dtype)] if add else []),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="pallasite_norm_quantize",
    )(*operands, weight)
    result = result if quantize else [result[0], None, *result[1:]]
    return result[0], result[1], (result[2] if add else None)


def norm_quantize_reference(x, weight, residual=None, residual_scales=None, *, eps,
                            plus_one=False, out=jnp.float8_e4m3fn):
    """The same in jnp, op for op as the model's add, `RMSNorm` and `quantize_rows`."""
    check(x, weight, residual, residual_scales, out)
    if residual_scales is not None:
        rows, cols = residual_scales
        residual = Product(residual, rows, cols, x.dtype).value()
    total = None if residual is None else x + residual
    x32 = (x if total is None else total).astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    h = _normed(x32, r, weight, x.dtype, plus_one)
    if out is None:
        return h, None, total
    return (*quantize_rows_as(h, out), total)
