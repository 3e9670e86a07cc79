"""FP8 x FP8 matrix product with float32 accumulation (W8A8, Pallas, Triton lowering).

x [M, K] is quantized per row (token) to float8_e4m3fn with a float32 scale [M, 1] by a
separate XLA pass (`quant_reference.quantize_rows`: one reduction and one conversion; fusing
it into the kernel would redo it in every column program). The weights come as q [K, N]
(`layout="kn"`, how `model/quant.py` stores them) or its transpose [N, K] (`layout="nk"`, both
operands contiguous along K, the only layout Hopper's FP8 warpgroup MMA reads from shared
memory without a transpose), float8_e4m3fn, with float32 scales [G, N]: G = 1 per output
channel, G > 1 one row per group of K // G input rows (block-wise [128, 128] checkpoints
expand to this form along N).

A program computes one [block_m, block_n] output tile over all of K in block_k steps. Per
channel, the row and column scales multiply the float32 sum once, in registers, before the
bf16 store (XLA's dot at least writes a float32 product and scales it in a fusion after it,
unless it folds the scales into the GEMM; `benchmarks/bench_w8a8.py` records the kernels). With
groups, each step's partial product is scaled by its group's row before it is added (block_k
divides the group). Programs run in `group_m`-row bands so that a wave re-reads weight tiles
from L2 (the Triton tutorial's ordering).

Precision: Pallas emits Triton's dot without `max_num_imprecise_acc`, and for FP8 operands with
a float32 result Triton then keeps a second, partial accumulator and adds it into the float32
one after every warpgroup MMA (32 of K): the sum is float32 throughout, as XLA's dot at
HIGHEST gives, at the cost of the partial accumulator's registers (a thread of an 8-warp
128x128 tile holds 64 + 64 floats) and its adds. There is no fast-accumulation form.
The jnp reference is `quant_reference.w8a8_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LAYOUTS = ("kn", "nk")


def _kernel(x_ref, xs_ref, q_ref, s_ref, o_ref, *, block_k: int, num_k: int, group_k: int,
            layout: str):
    grouped = s_ref.shape[0] > 1
    contract = 1 if layout == "nk" else 0  # the weight tile's K axis

    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        a = x_ref[:, pl.ds(k0, block_k)]
        b = q_ref[:, pl.ds(k0, block_k)] if layout == "nk" else q_ref[pl.ds(k0, block_k), :]
        part = lax.dot_general(a, b, (((1,), (contract,)), ((), ())),
                               preferred_element_type=jnp.float32)
        if not grouped:
            return acc + part
        return acc + part * s_ref[pl.ds(k0 // group_k, 1), :]

    acc = lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    acc = acc * xs_ref[...]
    if not grouped:
        acc = acc * s_ref[...]
    o_ref[...] = acc.astype(o_ref.dtype)


def _banded(p, *, rows: int, cols: int, group_m: int):
    """Program p -> (row block, column block): `group_m` row blocks walk the columns together."""
    band = group_m * cols
    first = (p // band) * group_m
    size = jnp.minimum(rows - first, group_m)
    return first + (p % band) % size, (p % band) // size


def supported(m: int, k: int, n: int, groups: int, *, block_n: int = 128, block_k: int = 128,
              **_) -> str | None:
    """Why this kernel cannot take an [m, k] x [k, n] call with `groups` scale rows, or None."""
    block_n, block_k = min(block_n, n), min(block_k, k)
    if n % block_n:
        return f"N={n} is not a multiple of block_n={block_n}"
    if k % block_k:
        return f"K={k} is not a multiple of block_k={block_k}"
    if k % groups or (k // groups) % block_k:
        return f"the scale groups of K={k} ({groups}) are not whole block_k={block_k} steps"
    return None


@functools.partial(jax.jit, static_argnames=("layout", "block_m", "block_n", "block_k",
                                             "group_m", "num_warps", "num_stages", "interpret"))
def w8a8_matmul_quantized(xq, xs, q, scale, *, layout: str = "kn", block_m: int = 128,
                          block_n: int = 128, block_k: int = 128, group_m: int = 8,
                          num_warps: int = 8, num_stages: int = 4, interpret: bool = False):
    """xq [M, K] float8_e4m3fn with row scales xs [M, 1] float32, times q ([K, N] for layout
    "kn", [N, K] for "nk") float8_e4m3fn with scale [G, N] float32 -> [M, N] bfloat16."""
    if layout not in LAYOUTS:
        raise ValueError(f"w8a8_matmul: layout {layout!r} is not one of {LAYOUTS}")
    if xq.dtype != jnp.float8_e4m3fn or q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w8a8_matmul takes float8_e4m3fn operands, not {xq.dtype} x {q.dtype}")
    m, k = xq.shape
    n = q.shape[0] if layout == "nk" else q.shape[1]
    groups = scale.shape[0]
    if (q.shape[1] if layout == "nk" else q.shape[0]) != k or scale.shape[1] != n:
        raise ValueError(f"w8a8_matmul: x {xq.shape}, q {q.shape} ({layout}) and scale "
                         f"{scale.shape} do not agree")
    why = supported(m, k, n, groups, block_n=block_n, block_k=block_k)
    if why:
        raise ValueError(f"w8a8_matmul: {why}")
    block_n, block_k = min(block_n, n), min(block_k, k)
    block_m = min(block_m, max(64, 1 << (m - 1).bit_length()))  # warpgroup MMAs: 64+ rows
    mp = -(-m // block_m) * block_m
    if mp != m:  # padded rows: zeros with scale 1, sliced off below
        xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
        xs = jnp.pad(xs, ((0, mp - m), (0, 0)), constant_values=1.0)
    rows, cols = mp // block_m, n // block_n
    ij = functools.partial(_banded, rows=rows, cols=cols, group_m=group_m)

    def tile(p, at):
        i, j = ij(p)
        return at(i, j)
    q_spec = (pl.BlockSpec((block_n, k), lambda p: tile(p, lambda i, j: (j, 0)))
              if layout == "nk" else
              pl.BlockSpec((k, block_n), lambda p: tile(p, lambda i, j: (0, j))))
    kernel = functools.partial(_kernel, block_k=block_k, num_k=k // block_k,
                               group_k=k // groups, layout=layout)
    out = pl.pallas_call(
        kernel,
        grid=(rows * cols,),
        in_specs=[pl.BlockSpec((block_m, k), lambda p: tile(p, lambda i, j: (i, 0))),
                  pl.BlockSpec((block_m, 1), lambda p: tile(p, lambda i, j: (i, 0))),
                  q_spec,
                  pl.BlockSpec((groups, block_n), lambda p: tile(p, lambda i, j: (0, j)))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda p: tile(p, lambda i, j: (i, j))),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.bfloat16),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w8a8_matmul",
    )(xq, xs, q, scale)
    return out[:m]


def w8a8_matmul(x, q, scale, *, layout: str = "kn", interpret: bool = False, **blocks):
    """x [M, K] (bf16/f32) quantized per row, times the FP8 weights -> [M, N] in x's dtype.
    Tiles: `blocks`, else the tuned entry for this shape (`tuning.QUANT_MATMUL["w8a8"]`), else
    the defaults of `w8a8_matmul_quantized`."""
    from .quant_reference import quantize_rows
    k, n = (q.shape[1], q.shape[0]) if layout == "nk" else q.shape
    xq, xs = quantize_rows(x)
    kw = blocks_for(x.shape[0], k, n) | blocks
    out = w8a8_matmul_quantized(xq, xs, q, scale, layout=layout, interpret=interpret, **kw)
    return out.astype(x.dtype)


def blocks_for(m: int, k: int, n: int) -> dict:
    """The tuned tiles for an [m, k] x [k, n] call, or {} (the kernel's defaults)."""
    from . import tuning
    return tuning.quant_params("w8a8", m, k, n) or {}
