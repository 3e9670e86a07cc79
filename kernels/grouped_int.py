"""Grouped weight-only integer matmul (W4A16, W8A16) for mixture-of-experts layers (Pallas,
Triton lowering), and its jnp reference.

Each expert's [K, N] weight is packed as `w4a16_matmul.pack_weight` packs one dense weight, and
the experts are stacked on a leading axis (`IntExperts`):

  words   int32 [E, K_pad * bits / 32, N]   the bit-plane tiles of `w4a16_matmul.pack`
  scale   float32 [E, K_pad / group_size, N]
  zero    bfloat16 [E, K_pad / group_size, N] (unsigned code of 0), None: 2**(bits - 1)
  perm    int32 [E, K] or None: act order, expert e's stored row i is input row perm[e, i]

Rows are laid out as `grouped_matmul.pad_groups` lays them out (each expert's rows in blocks of
`block_m` that hold one expert). A program multiplies one row block by one column tile of its
expert's weights: per K tile it reads SLAB rows of words and gets 32 // bits weight slabs from
them with one shift and one mask each. The MMAs of the slabs of one group are chained, and the
group's zero and scale are applied once to their sum: INT4 codes with bf16 activations unpack
as bf16 128 + c by their bit pattern (no conversion) and 128 + zero comes off with the row sums
of x; otherwise the zero is subtracted from each slab in the activations' dtype (small
integers: exact). Programs of empty blocks write zeros and read no weights, so the
weights read follow the experts that have rows.

Act order: each padded row's columns are gathered into its expert's stored order before the
product (one XLA gather, as the dense path gathers x's columns).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import grouped_matmul as gm
from . import w4a16_matmul as im
from .reference import grouped_mlp_reference, silu_glu

SLAB = im.SLAB
# Row blocks up to this size (asked for with block_m; the default blocks are 16 or 64 rows)
# take float32 FMAs instead of an MMA: at a row an expert (decode) a one-row block reads each
# expert's weights once for its row, not for 16 mostly padded ones. Not yet timed on a GPU.
FMA_MAX_ROWS = 8


class IntExperts(NamedTuple):
    """Stacked packed INT4/INT8 expert weights, the operand `kernels.grouped_mlp` takes for
    integer experts (see the module docstring for the arrays)."""
    words: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    perm: jax.Array | None
    bits: int
    group_size: int

    @property
    def k_pad(self) -> int:
        return self.words.shape[1] * (32 // self.bits)

    @property
    def n(self) -> int:
        return self.words.shape[2]


def pack_experts(codes, scales, zeros, *, bits: int, group_size: int):
    """Per-expert codes [K, N] with scale (and zero, or None) [ceil(K / group_size), N] ->
    (words [E, ...], scale [E, ...], zero [E, ...] or None, group_size): each packed by
    `w4a16_matmul.pack_weight`, stacked. Zeros are all given or all None."""
    packed = [im.pack_weight(c, s, z, bits=bits, group_size=group_size)
              for c, s, z in zip(codes, scales, zeros)]
    words = jnp.stack([jnp.asarray(p[0]) for p in packed])
    scale = jnp.stack([jnp.asarray(p[1]) for p in packed])
    zero = None if packed[0][2] is None else jnp.stack([p[2] for p in packed])
    return words, scale, zero, packed[0][3]


def dequantize(w: IntExperts, k: int | None = None):
    """The float32 weights [E, K, N] the packed experts stand for, rows in input order."""
    one = lambda words, scale, zero: im.dequantize(words, scale, zero, bits=w.bits,
                                                   group_size=w.group_size, k=k)
    if w.zero is None:
        deq = jax.vmap(lambda words, scale: one(words, scale, None))(w.words, w.scale)
    else:
        deq = jax.vmap(one)(w.words, w.scale, w.zero)
    if w.perm is not None:
        deq = jnp.take_along_axis(deq, jnp.argsort(w.perm, axis=1)[:, :, None], axis=1)
    return deq


def grouped_int_matmul_reference(x, group_sizes, w: IntExperts):
    """`lax.ragged_dot(x, dequantized experts, group_sizes)` in float32 -> [M, N] in x's
    dtype: x [M, K] sorted by expert; rows past sum(group_sizes) give zeros."""
    deq = dequantize(w, x.shape[-1])
    y = lax.ragged_dot(x.astype(jnp.float32), deq, group_sizes,
                       precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def _kernel(group_ref, x_ref, w_ref, s_ref, *rest, bits: int, group_size: int, num_tiles: int,
            tiles_per_split: int, per_group: bool):
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    e = group_ref[pl.program_id(0)]
    lo = pl.program_id(2) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)
    per, tile = 32 // bits, im.tile_rows(bits)
    bm, block_n = o_ref.shape
    fma = bm <= FMA_MAX_ROWS  # too few rows for an MMA: float32 FMAs, a group at a time
    span = math.gcd(group_size, tile) // SLAB if per_group or fma else 1  # slabs a scaling
    magic = per_group and bits == 4 and x_ref.dtype == jnp.bfloat16
    cols = pl.ds(pl.program_id(1) * block_n, block_n)

    def zero_of(g):
        return (2.0 ** (bits - 1) if z_ref is None
                else z_ref[e, pl.ds(g, 1), cols].astype(jnp.float32))

    def chunk(words, t, c, acc):
        """Slabs c * span ... of tile t (one group; bit plane j holds the tile's rows j * SLAB):
        their MMAs chained, then the group's zero and scale (`w4a16_matmul.mma_group`)."""
        g = (t * tile + c * span * SLAB) // group_size
        part = im.mma_group(words, range(c * span, (c + 1) * span),
                            lambda j: x_ref[:, pl.ds(t * tile + j * SLAB, SLAB)], bits,
                            zero_of(g), magic)
        return acc + part * s_ref[e, pl.ds(g, 1), cols]

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    def fma_chunk(words, t, c, accs, corrs):
        """Few rows: one group's slabs by FMA on 1 + c/2**bits (`w4a16_matmul.fma_group`)."""
        g = (t * tile + c * span * SLAB) // group_size
        rows = lambda j: [x_ref[r, pl.ds(t * tile + j * SLAB, SLAB)].astype(jnp.float32)
                          for r in range(bm)]
        return im.fma_group(words, range(c * span, (c + 1) * span), rows, bits, zero_of(g),
                            s_ref[e, pl.ds(g, 1), cols], accs, corrs)

    @pl.when(e >= 0)
    def _():
        def body(t, acc):
            words = w_ref[e, pl.ds(pl.multiple_of(t * SLAB, SLAB), SLAB), cols]
            for c in range(per // span):
                acc = fma_chunk(words, t, c, *acc) if fma else chunk(words, t, c, acc)
            return acc
        if not fma:
            acc = lax.fori_loop(lo, hi, body, jnp.zeros(o_ref.shape, jnp.float32))
            o_ref[...] = acc.astype(o_ref.dtype)
            return
        accs, corrs = lax.fori_loop(lo, hi, body, ([jnp.zeros((SLAB, block_n), jnp.float32)] * bm,
                                                   [jnp.zeros((1, block_n), jnp.float32)] * bm))
        for r, (a, q) in enumerate(zip(accs, corrs)):
            o_ref[pl.ds(r, 1), :] = im.fma_result(a, q, bits).astype(o_ref.dtype)


def block_n_for(n: int, block_n: int = 128) -> int:
    """Columns a program: `block_n`, or the largest power of two below it dividing N (N
    itself when it is at most block_n)."""
    if n <= block_n:
        return n
    b = block_n
    while n % b:
        b //= 2
    return b


def supported(ws) -> bool:
    """Whether the Triton kernels take these three weights: packed ones in power-of-two
    column tiles of 16-128, plain ones in multiples of 128 rows and columns (as
    `kernels.grouped_mlp` asks of bf16 experts)."""
    for w in ws:
        if isinstance(w, IntExperts):
            b = block_n_for(w.n)
            if b < 16 or b & (b - 1):
                return False
        elif w.shape[-1] % 128 or w.shape[-2] % 128:
            return False
    return True


def splits_for(live_blocks: int, col_tiles: int, num_tiles: int, target_programs: int = 264):
    """Split-K for few live row blocks (decode): about two programs an SM in all."""
    return int(max(1, min(target_programs // max(live_blocks * col_tiles, 1), num_tiles, 16)))


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_n", "num_splits",
                                             "num_warps", "num_stages", "per_group",
                                             "interpret"))
def grouped_int_matmul_padded(x_pad, words, scale, zero, block_group, *, bits: int,
                              group_size: int, block_n: int = 128, num_splits: int = 1,
                              num_warps: int = 4, num_stages: int = 3, per_group: bool = True,
                              interpret: bool = False):
    """x_pad [R, K_pad] in pad_groups' layout (columns in each row's expert's stored order,
    K padded with zero columns to the packed tile) times the packed experts -> [R, N] in x's
    dtype, zeros in empty blocks. `num_splits` > 1 cuts K among that many programs a block,
    whose float32 partial products are summed after. `per_group` chains the MMAs of a group's
    slabs and applies its zero and scale once (INT4 codes then unpack as bf16 128 + c); off,
    each slab's product is scaled on its own."""
    rows, k_pad = x_pad.shape
    experts, word_rows, n = words.shape
    block_m = rows // block_group.shape[0]
    block_n = block_n_for(n, block_n)
    if k_pad != word_rows * (32 // bits) or n % block_n or rows % block_m:
        raise ValueError(f"grouped int matmul: x {x_pad.shape} and words {words.shape} do not "
                         f"fit bits={bits}, block_m={block_m}, block_n={block_n}")
    im.check_group(group_size, k_pad)
    groups = scale.shape[1]
    num_tiles = k_pad // im.tile_rows(bits)
    num_splits = max(1, min(num_splits, num_tiles))
    kernel = functools.partial(_kernel, bits=bits, group_size=group_size, num_tiles=num_tiles,
                               tiles_per_split=-(-num_tiles // num_splits), per_group=per_group)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))
    in_specs = [whole((block_group.shape[0],)),
                pl.BlockSpec((block_m, k_pad), lambda i, j, s: (i, 0)),
                whole((experts, word_rows, n)), whole((experts, groups, n))]
    args = [block_group, x_pad, words, scale]
    if zero is not None:
        in_specs.append(whole((experts, groups, n)))
        args.append(zero)
    split = num_splits > 1
    out = pl.pallas_call(
        kernel,
        grid=(block_group.shape[0], n // block_n, num_splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, rows, n),
                                       jnp.float32 if split else x_pad.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_int_matmul",
    )(*args)
    return out.sum(0).astype(x_pad.dtype) if split else out[0]


def live_blocks(m: int, experts: int, block_m: int) -> int:
    """The most row blocks M rows can fill: each expert with rows starts a block of its own."""
    return -(-m // block_m) + min(experts, m)


def row_experts(block_group, block_m: int):
    """The expert of each padded row (0 for the rows of empty blocks, which are dropped)."""
    return jnp.repeat(jnp.maximum(block_group, 0), block_m,
                      total_repeat_length=block_group.shape[0] * block_m)


def _operand_rows(x_pad, w: IntExperts, block_group):
    """x_pad's columns in each row's expert's stored order (one permutation a row block),
    padded to the packed K."""
    rows, k = x_pad.shape
    if w.perm is not None:
        blocks = block_group.shape[0]
        order = w.perm[jnp.maximum(block_group, 0)][:, None, :]  # [blocks, 1, K]
        x_pad = jnp.take_along_axis(x_pad.reshape(blocks, rows // blocks, k), order,
                                    axis=2).reshape(rows, k)
    return x_pad if k == w.k_pad else jnp.pad(x_pad, ((0, 0), (0, w.k_pad - k)))


def _matmul_padded(x_pad, w, block_group, *, interpret, live_blocks=None, **blocks):
    """One product on the padded layout: packed experts, or plain [E, K, N] weights (the
    bf16 grouped kernel). `live_blocks`: at most this many row blocks hold rows (split-K
    fills the GPU when they are few)."""
    if isinstance(w, IntExperts):
        if x_pad.shape[0] // block_group.shape[0] <= FMA_MAX_ROWS:  # FMA rows: narrower tiles
            blocks = dict(blocks, block_n=blocks.get("block_n", 64))
        if "num_splits" not in blocks and live_blocks is not None:
            col_tiles = w.n // block_n_for(w.n, blocks.get("block_n", 128))
            blocks = dict(blocks, num_splits=splits_for(
                live_blocks, col_tiles, w.k_pad // im.tile_rows(w.bits)))
        return grouped_int_matmul_padded(_operand_rows(x_pad, w, block_group), w.words,
                                         w.scale, w.zero, block_group, bits=w.bits,
                                         group_size=w.group_size, interpret=interpret,
                                         **blocks)
    return gm.grouped_matmul_padded(x_pad, w.astype(x_pad.dtype), block_group,
                                    interpret=interpret, **blocks)


def grouped_int_matmul(x, group_sizes, w: IntExperts, *, block_m: int | None = None,
                       interpret: bool = False, **blocks):
    """`grouped_int_matmul_reference` through the kernel: x [M, K] sorted by expert ->
    [M, N] in x's dtype."""
    block_m = block_m or gm.block_m_for(x.shape[0], w.words.shape[0])
    x_pad, dest, block_group = gm.pad_groups(x, group_sizes, block_m)
    y = _matmul_padded(x_pad, w, block_group, interpret=interpret,
                       live_blocks=live_blocks(x.shape[0], w.words.shape[0], block_m), **blocks)
    return gm.unpad_groups(y, dest)


def grouped_int_mlp(x, group_sizes, w_gate, w_up, w_down, *, glu=None, biases=None,
                    block_m: int | None = None, interpret: bool = False, **blocks):
    """Gated experts (`glu(gate, up)`, SwiGLU by default; optional per-expert `biases`
    b_gate [E, F], b_up [E, F], b_down [E, D]) over rows sorted by expert, any of the three
    weights packed (`IntExperts`) and the others plain [E, K, N]: the rows are laid out once
    and the three products run there."""
    glu = glu or silu_glu
    experts_n = (w_gate.words if isinstance(w_gate, IntExperts) else w_gate).shape[0]
    block_m = block_m or gm.block_m_for(x.shape[0], experts_n)
    x_pad, dest, block_group = gm.pad_groups(x, group_sizes, block_m)
    live = live_blocks(x.shape[0], experts_n, block_m)
    mm = lambda a, w: _matmul_padded(a, w, block_group, interpret=interpret, live_blocks=live,
                                     **blocks)
    gate, up = mm(x_pad, w_gate), mm(x_pad, w_up)
    if biases is not None:
        experts = row_experts(block_group, block_m)
        gate, up = gate + biases[0][experts], up + biases[1][experts]
    y = mm(glu(gate, up).astype(x.dtype), w_down)
    if biases is not None:
        y = y + biases[2][experts]
    return gm.unpad_groups(y, dest)


def grouped_int_mlp_reference(x, group_sizes, w_gate, w_up, w_down, *, glu=None,
                              biases=None):
    """The same with every packed weight dequantized (to x's dtype) and `lax.ragged_dot`."""
    def plain(w, k):
        return dequantize(w, k).astype(x.dtype) if isinstance(w, IntExperts) else w
    w_gate, w_up = plain(w_gate, x.shape[-1]), plain(w_up, x.shape[-1])
    w_down = plain(w_down, w_gate.shape[-1])
    return grouped_mlp_reference(x, group_sizes, w_gate, w_up, w_down, glu=glu or silu_glu,
                                 biases=biases)
