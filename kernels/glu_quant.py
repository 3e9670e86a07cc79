"""SwiGLU between two 8-bit products, in one pass: the raw gate/up product of a W8A8 GEMM in,
the down projection's row-quantized input out (Pallas, Triton backend).

p [M, 2, F] is the unscaled product of the per-row quantized input and the fused gate/up
weight (bf16 from FP8 GEMMs, int32 from INT8 ones). Row r's gate and up are
p[r, i] * row_scale[r] * col_scale[i], h = silu(gate) * up in float32, and h leaves quantized
per row as the next W8A8 product takes it: (hq [M, F] float8_e4m3fn or int8, hs [M, 1] float32),
as `quant_reference.quantize_rows` / `quantize_rows_int8` would make them from h.

Done as XLA fusions this is three passes over the [M, F] activation: the scaling and SwiGLU,
the rows' absolute maximum, and the quantization (5.1 ms of a 2048-token prefill step of the 8B
shape on the H100, `profiling/profile_step.py --cases p2k --quantization fp8`). Here a program
holds one row of h in registers (F / 2048 pieces of 2048), so p is read once and only the 8-bit
h is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .norm_quant import piece as _piece, store_rows
from .quant_reference import quantize_rows_as


def _kernel(p_ref, rs_ref, cs_ref, hq_ref, hs_ref, *, piece):
    f = hq_ref.shape[1]
    rs = rs_ref[0, 0]
    hs = []
    for c in range(f // piece):  # the row's pieces stay in registers until its scale is known
        at = pl.ds(c * piece, piece)
        gate = p_ref[0, 0, at].astype(jnp.float32) * (cs_ref[0, at] * rs)
        up = p_ref[0, 1, at].astype(jnp.float32) * (cs_ref[1, at] * rs)
        hs.append(gate * jax.nn.sigmoid(gate) * up)
    store_rows(hs, hq_ref, hs_ref, piece)


# 16 warps a program (28 of a row's values a thread): 0.0744 / 0.2794 ms at 2048 / 8192 rows of
# the 8B MLP, against 0.0747 / 0.2922 with 8, 0.1009 / 0.3842 with 4 and 0.0802 / 0.3018 with
# 32 (H100, `benchmarks/bench_glu.py --warps`); XLA's three passes 0.1011 / 0.3902.
@functools.partial(jax.jit, static_argnames=("out", "num_warps", "interpret"))
def glu_quantize(p, row_scale, col_scale, *, out=jnp.float8_e4m3fn, num_warps=16,
                 interpret=False):
    """p [M, 2, F], row_scale [M, 1], col_scale [2, F] -> (hq [M, F] in `out`, hs [M, 1]):
    silu(gate) * up quantized per row (float8_e4m3fn or int8)."""
    M, two, F = p.shape
    if two != 2 or row_scale.shape != (M, 1) or col_scale.shape != (2, F):
        raise ValueError(f"glu_quantize takes p [M, 2, F], row_scale [M, 1], col_scale [2, F]; "
                         f"got {p.shape}, {row_scale.shape}, {col_scale.shape}")
    if jnp.dtype(out) not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8)):
        raise ValueError(f"glu_quantize writes float8_e4m3fn or int8, not {out}")
    row = lambda *shape: pl.BlockSpec((1, *shape), lambda r: (r,) + (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_kernel, piece=_piece(F)),
        grid=(M,),
        in_specs=[row(2, F), row(1), pl.BlockSpec((2, F), lambda r: (0, 0))],
        out_specs=[row(F), row(1)],
        out_shape=[jax.ShapeDtypeStruct((M, F), out),
                   jax.ShapeDtypeStruct((M, 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="pallasite_glu_quantize",
    )(p, row_scale.astype(jnp.float32), col_scale.astype(jnp.float32))


def glu_quantize_reference(p, row_scale, col_scale, *, out=jnp.float8_e4m3fn):
    """The same math in jnp."""
    y = p.astype(jnp.float32) * row_scale[:, :, None] * col_scale[None]
    gate, up = y[:, 0], y[:, 1]
    return quantize_rows_as(gate * jax.nn.sigmoid(gate) * up, out)
