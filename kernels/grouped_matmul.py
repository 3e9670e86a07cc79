"""Grouped matrix product for mixture-of-experts layers (Pallas, Triton lowering).

`x` [M, K] holds rows sorted by group (expert) with `group_sizes` [G] rows each; group g's rows
are multiplied by `w[g]` [K, N] — what `lax.ragged_dot` computes. XLA:GPU expands `ragged_dot`
into work over every group for every row, so a layer of 128 experts costs 128 dense products.

Here each group's rows are first laid out in blocks of `block_m` rows that belong to one group
(`pad_groups`: a scatter, padding each group to a multiple of `block_m`); a program then
multiplies one row block by one column tile of its group's weights, and programs of empty blocks
only write zeros. Work and weight reads scale with the rows that exist, and an expert with no
rows is never read. An MoE MLP pads once and runs its three products on the padded layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def padded_rows(m: int, groups: int, block_m: int) -> int:
    """Rows of the padded layout: every group may waste up to block_m - 1 rows."""
    return -(-(m + groups * (block_m - 1)) // block_m) * block_m


def pad_groups(x, group_sizes, block_m: int):
    """x [M, K] sorted by group -> (x_pad [R, K], dest [M], block_group [R // block_m]).
    Group g starts at a multiple of block_m; dest[i] is row i's padded row (R for rows past
    sum(group_sizes), which are dropped); block_group is -1 for blocks holding no row."""
    m, groups = x.shape[0], group_sizes.shape[0]
    rows = padded_rows(m, groups, block_m)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded = -(-sizes // block_m) * block_m
    pad_ends = jnp.cumsum(padded)
    pad_starts = pad_ends - padded
    i = jnp.arange(m, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), groups - 1)
    dest = jnp.where(i < ends[-1], pad_starts[g] + i - starts[g], rows)
    x_pad = jnp.zeros((rows, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    first = jnp.arange(0, rows, block_m, dtype=jnp.int32)
    bg = jnp.searchsorted(pad_ends, first, side="right", method="compare_all")
    block_group = jnp.where(bg < groups, bg, -1).astype(jnp.int32)
    return x_pad, dest, block_group


def unpad_groups(y_pad, dest):
    """Back to the sorted row order; dropped rows (dest = R) come back as zeros."""
    return jnp.take(y_pad, dest, axis=0, mode="fill", fill_value=0)


def _kernel(group_ref, x_ref, w_ref, *rest, block_k: int, num_k: int):
    s_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    g = group_ref[pl.program_id(0)]
    block_n = o_ref.shape[1]
    n0 = pl.program_id(1) * block_n

    @pl.when(g < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(g >= 0)
    def _():
        def body(k, acc):
            xs = x_ref[:, pl.ds(k * block_k, block_k)]
            ws = w_ref[g, pl.ds(k * block_k, block_k), pl.ds(n0, block_n)]
            return acc + plgpu.dot(xs, ws.astype(xs.dtype))  # quantized: dequantized here
        acc = lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
        if s_ref is not None:  # per-output-channel scales of this group
            acc = acc * s_ref[g, :, pl.ds(n0, block_n)]
        o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def grouped_matmul_padded(x_pad, w, block_group, scale=None, *, block_n: int = 128, block_k: int = 64,
                          num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """x_pad [R, K] in pad_groups' layout, w [G, K, N] -> [R, N] (zeros in empty blocks).
    Quantized w (float8 / int8 values) comes with float32 per-channel `scale` [G, 1, N]."""
    rows, k = x_pad.shape
    groups, _, n = w.shape
    block_m = rows // block_group.shape[0]
    block_n, block_k = min(block_n, n), min(block_k, k)
    if n % block_n or k % block_k:
        raise ValueError(f"grouped_matmul: N={n} and K={k} must be multiples of block_n="
                         f"{block_n} and block_k={block_k}")
    kernel = functools.partial(_kernel, block_k=block_k, num_k=k // block_k)
    return pl.pallas_call(
        kernel,
        grid=(block_group.shape[0], n // block_n),
        in_specs=[pl.BlockSpec((block_group.shape[0],), lambda i, j: (0,)),
                  pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((groups, k, n), lambda i, j: (0, 0, 0))]
                 + ([] if scale is None else [pl.BlockSpec((groups, 1, n), lambda i, j: (0, 0, 0))]),
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x_pad.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(block_group, x_pad, w, *([] if scale is None else [scale]))


def block_m_for(m: int, groups: int) -> int:
    """Few rows per group (decode): small blocks waste less; many (prefill): 64-row blocks."""
    return 16 if m <= 4 * groups else 64


def grouped_matmul(x, w, group_sizes, *, block_m: int | None = None, interpret: bool = False,
                   **blocks):
    """`lax.ragged_dot(x, w, group_sizes)`: x [M, K] sorted by group, w [G, K, N] -> [M, N]."""
    block_m = block_m or block_m_for(x.shape[0], w.shape[0])
    x_pad, dest, block_group = pad_groups(x, group_sizes, block_m)
    y = grouped_matmul_padded(x_pad, w, block_group, interpret=interpret, **blocks)
    return unpad_groups(y, dest)
