"""Weight-only integer matmul (W4A16, W8A16): bf16 activations times INT4/INT8 weights with
group-wise scales and optional zero points (Pallas, Triton lowering), and its jnp reference.

Weights [K, N] hold unsigned codes u in [0, 2**bits); the weight is (u - zero) * scale, with one
scale (and zero) per group of `group_size` consecutive rows of K and per column. Symmetric
weights carry no zero array: their zero is 2**(bits - 1).

Packed layout (`pack`, done once at load, as Marlin repacks): 32 // bits codes share an int32
word. K is cut into tiles of SLAB * (32 // bits) rows; in a tile, bit plane j of word row r
holds row j * SLAB + r. A program reads one [SLAB, block_n] block of words per tile and gets
32 // bits [SLAB, block_n] weight slabs from it with one shift and one mask each (no reshape in
registers); every slab lies in one group (group sizes are multiples of SLAB), so its
subtraction of the zero is exact in bf16 and its scale multiplies the slab's f32 product, once
per output element rather than once per weight. The per-group forms (`_group_kernel`) go
further: the slabs of one group are summed first (chained MMAs, or FMAs for a few rows) and the
group's zero and scale applied once to that sum.

Split-K: for few rows (decode) the [M, N] output has too few column blocks to fill the GPU, so
`num_splits` programs share each block's K tiles and write f32 partial sums that one XLA
reduction adds. Act-order checkpoints (GPTQ `g_idx`) are sorted by group at load; `perm` then
gathers the activations' columns into the same order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SLAB = 32  # K rows per bit plane of a tile: one dot's depth, and the granule of group sizes
BITS = (4, 8)


def tile_rows(bits: int, slab: int = SLAB) -> int:
    """K rows of one packed tile (256 for INT4, 128 for INT8)."""
    return slab * (32 // bits)


def padded_k(k: int, bits: int, slab: int = SLAB) -> int:
    t = tile_rows(bits, slab)
    return -(-k // t) * t


def check_group(group_size: int, k_pad: int):
    if group_size % SLAB or k_pad % group_size and group_size < k_pad:
        raise ValueError(f"int matmul: group_size={group_size} must be a multiple of {SLAB} "
                         f"(and divide the padded K={k_pad}, or cover it)")


def pack(codes, bits: int, slab: int = SLAB) -> jax.Array:
    """Unsigned codes [K, N] (each < 2**bits) -> int32 words [K_pad // (32 // bits), N], K padded
    with zero codes to a multiple of `tile_rows(bits, slab)` (jnp: on the host or traced).
    `slab`: the rows of a bit plane (the Hopper kernel's transposed layout takes 16)."""
    if bits not in BITS:
        raise ValueError(f"int matmul: bits={bits} is not one of {BITS}")
    k, n = codes.shape
    per, k_pad = 32 // bits, padded_k(k, bits, slab)
    full = jnp.pad(jnp.asarray(codes, jnp.uint32), ((0, k_pad - k), (0, 0)))
    planes = full.reshape(k_pad // tile_rows(bits, slab), per, slab, n)
    words = sum(planes[:, j] << (bits * j) for j in range(per))  # disjoint bits: sum is OR
    return lax.bitcast_convert_type(words.reshape(k_pad // per, n), jnp.int32)


def pack_groups(a, k_pad: int, group_size: int, fill, dtype):
    """Per-group rows [ceil(K / group_size), N] padded to cover K_pad (`fill` in the new rows)."""
    a = jnp.asarray(a, dtype)
    rows = -(-k_pad // group_size)
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)), constant_values=fill)


def pack_weight(codes, scale, zero, *, bits: int, group_size: int):
    """Codes [K, N], scale (and zero, or None) [ceil(K / group_size), N] -> the kernel's arrays:
    (int32 words, f32 scale, bf16 zero or None), padded to the tile. `group_size` is K's
    multiple of SLAB, or >= K for one group per column (channel-wise)."""
    k = codes.shape[0]
    k_pad = padded_k(k, bits)
    group_size = k_pad if group_size >= k else group_size
    check_group(group_size, k_pad)
    scale = pack_groups(scale, k_pad, group_size, 1.0, jnp.float32)
    if zero is not None:
        zero = pack_groups(zero, k_pad, group_size, 0.0, jnp.float32).astype(jnp.bfloat16)
    return pack(codes, bits), scale, zero, group_size


def unpack(words, bits: int, k: int | None = None, slab: int = SLAB):
    """int32 words -> int32 codes [K, N] (the first `k` rows; all K_pad without it)."""
    per, n = 32 // bits, words.shape[-1]
    w = words.reshape(-1, 1, slab, n)
    shifts = (jnp.arange(per, dtype=jnp.int32) * bits).reshape(1, per, 1, 1)
    codes = ((w >> shifts) & ((1 << bits) - 1)).reshape(-1, n)
    return codes if k is None else codes[:k]


def dequantize(words, scale, zero, *, bits: int, group_size: int, k: int | None = None):
    """The f32 weight [K, N] that the packed arrays stand for."""
    w = dequantize_codes(unpack(words, bits), scale, zero, bits=bits, group_size=group_size)
    return w if k is None else w[:k]


def dequantize_codes(codes, scale, zero, *, bits: int, group_size: int):
    """Codes [K, N] with their groups' scale (and zero) -> the f32 weight [K, N]."""
    rows = jnp.arange(codes.shape[0]) // group_size
    z = 2.0 ** (bits - 1) if zero is None else zero.astype(jnp.float32)[rows]
    return (codes.astype(jnp.float32) - z) * scale.astype(jnp.float32)[rows]


def int_matmul_reference(x, words, scale, zero=None, perm=None, *, bits: int, group_size: int):
    """x [M, K] @ dequantized weights, in f32, -> [M, N] in x's dtype."""
    if perm is not None:
        x = x[..., perm]
    k = x.shape[-1]
    w = dequantize(words, scale, zero, bits=bits, group_size=group_size, k=k)
    y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


# Bit patterns that make a code a float with one OR, no integer-to-float conversion (a quarter-
# rate instruction on Hopper, which capped the first kernel at 0.3-0.5 TB/s): bf16 0x4300 | c is
# 128 + c for c < 128 (8 significant bits hold 128..255), f32 0x4B000000 | c is 2**23 + c.
BF16_MAGIC, BF16_BIAS = 0x4300, 128.0
F32_MAGIC, F32_BIAS = 0x4B000000, 2.0 ** 23
F32_ONE = 0x3F800000  # 1.0: a code in the top mantissa bits makes 1 + c / 2**bits
UNPACKS = ("convert", "magic")
MMA_REDUCES = ("dot", "dot_group")
REDUCES = MMA_REDUCES + ("sum", "acc", "acc_group")


def _kernel(x_ref, w_ref, s_ref, *rest, bits, group_size, tiles_per_split, num_tiles, unpack,
            reduce, swap):
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    per, mask, tile = 32 // bits, (1 << bits) - 1, tile_rows(bits)
    lo = pl.program_id(2) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)

    def zero_of(g):
        return 2.0 ** (bits - 1) if z_ref is None else z_ref[pl.ds(g, 1), :].astype(jnp.float32)

    bm = o_ref.shape[-2]
    one_d = len(x_ref.shape) == 1  # one row, x as a vector

    def rows(k0):
        """Each row's SLAB columns of x from k0, float32 (the multiply-and-sum paths)."""
        if one_d:
            return [x_ref[pl.ds(k0, SLAB)].astype(jnp.float32)]
        return [x_ref[r, pl.ds(k0, SLAB)].astype(jnp.float32) for r in range(bm)]

    def slab(words, t, j):
        """(x columns, weight slab, zero, scale) of bit plane j of tile t."""
        k0 = t * tile + j * SLAB
        g = k0 // group_size
        raw = (words >> (bits * j)) & mask
        if reduce != "dot":  # f32 2**23 + c; minus 2**23 + zero is exact
            w = lax.bitcast_convert_type(raw | F32_MAGIC, jnp.float32) - (F32_BIAS + zero_of(g))
            return rows(k0), w, None, s_ref[pl.ds(g, 1), :]
        xs = x_ref[:, pl.ds(k0, SLAB)]
        if unpack == "magic":  # bf16 128 + c; 128 + zero comes off after the dot
            w = lax.bitcast_convert_type((raw | BF16_MAGIC).astype(jnp.int16), jnp.bfloat16)
            return xs, w, BF16_BIAS + zero_of(g), s_ref[pl.ds(g, 1), :]
        w = (raw.astype(jnp.float32) - zero_of(g)).astype(xs.dtype)  # small ints: exact
        return xs, w, None, s_ref[pl.ds(g, 1), :]

    def body(t, accs):
        words = w_ref[pl.ds(pl.multiple_of(t * SLAB, SLAB), SLAB), :]
        accs = list(accs)
        for j in range(per):
            xs, w, zero, scale = slab(words, t, j)
            if reduce == "sum":  # each row its own accumulator
                accs = [a + jnp.sum(x[:, None] * w, axis=0, keepdims=True) * scale
                        for a, x in zip(accs, xs)]
                continue
            if reduce == "acc":  # summed over K once, after the loop
                ws = w * scale
                accs = [a + x[:, None] * ws for a, x in zip(accs, xs)]
                continue
            if swap:  # out^T = w^T x^T: the weight slab fills the MMA's rows
                part = plgpu.dot(w, xs, trans_a=True, trans_b=True)
                zero, scale = getattr(zero, "T", zero), scale.T  # zero: None, a float or [1, N]
                xsum = lambda: jnp.sum(xs.astype(jnp.float32), axis=1)[None, :]
            else:
                part = plgpu.dot(xs, w)
                xsum = lambda: jnp.sum(xs.astype(jnp.float32), axis=1, keepdims=True)
            if zero is not None:  # x . (c + 128) - (zero + 128) * sum(x): exact inputs
                part = part - xsum() * zero
            accs = [accs[0] + part * scale]
        return tuple(accs)

    bn = o_ref.shape[-1]
    if reduce == "dot":
        shapes = [(bn, bm) if swap else (bm, bn)]
    else:
        shapes = [(SLAB if reduce == "acc" else 1, bn)] * bm
    accs = lax.fori_loop(lo, hi, body, tuple(jnp.zeros(sh, jnp.float32) for sh in shapes))
    for r, acc in enumerate(accs):
        if reduce == "acc":
            acc = jnp.sum(acc, axis=0, keepdims=True)
        acc = (acc.T if swap else acc).astype(o_ref.dtype)
        if reduce == "dot" or one_d:
            o_ref[...] = acc.reshape(o_ref.shape)
        else:
            o_ref[pl.ds(r, 1), :] = acc


def one_plus(words, j: int, bits: int):
    """Bit plane j of the words as float32 1 + c / 2**bits: the code moved into the top of the
    mantissa under the bits of 1.0 (a shift, an AND and an OR; no conversion)."""
    top = 23 - bits
    shift = top - bits * j
    moved = words << shift if shift >= 0 else words >> -shift
    return lax.bitcast_convert_type((moved & (((1 << bits) - 1) << top)) | F32_ONE, jnp.float32)


def mma_group(words, planes, x_cols, bits: int, zero, magic: bool, swap: bool = False):
    """One group's bit planes through chained MMAs: the group's product before its scale
    ([M, N], or [N, M] with `swap`, which computes w^T x^T). `magic` (INT4, bf16 x): codes
    unpack as bf16 128 + c and 128 + zero comes off with the rows' sums of x; otherwise the zero
    is subtracted in x's dtype (small integers: exact). `x_cols(j)`: x's SLAB columns under
    plane j."""
    part, xsum = None, 0.0
    for j in planes:
        xs = x_cols(j)
        raw = (words >> (bits * j)) & ((1 << bits) - 1)
        if magic:
            w = lax.bitcast_convert_type((raw | BF16_MAGIC).astype(jnp.int16), jnp.bfloat16)
            xsum = xsum + jnp.sum(xs.astype(jnp.float32), axis=1, keepdims=True)
        else:
            w = (raw.astype(jnp.float32) - zero).astype(xs.dtype)
        p = plgpu.dot(w, xs, trans_a=True, trans_b=True) if swap else plgpu.dot(xs, w)
        part = p if part is None else part + p
    if magic:
        part = part - (xsum.T if swap else xsum) * _t(BF16_BIAS + zero, swap)
    return part


def fma_group(words, planes, x_rows, bits: int, zero, scale, accs, corrs):
    """One group's bit planes by FMA, for a few rows: each row's [SLAB, N] sum of x * (1 +
    c/2**bits) and its sum of x, then the group's scale on the first and (1 + zero/2**bits)
    times the scale on the second, into the rows' running `accs` and `corrs`. `x_rows(j)`:
    each row's SLAB columns under plane j, float32."""
    part, xsum = None, None
    for j in planes:
        w, xs = one_plus(words, j, bits), x_rows(j)
        prods = [x[:, None] * w for x in xs]
        part = prods if part is None else [p + q for p, q in zip(part, prods)]
        sums = [jnp.sum(x) for x in xs]
        xsum = sums if xsum is None else [a + b for a, b in zip(xsum, sums)]
    off = (1.0 + zero / 2 ** bits) * scale
    return ([a + p * scale for a, p in zip(accs, part)],
            [q + x * off for q, x in zip(corrs, xsum)])


def fma_result(acc, corr, bits: int):
    """A row's [1, N] product from `fma_group`'s running sums: x . (c - zero) * scale."""
    return 2.0 ** bits * (jnp.sum(acc, axis=0, keepdims=True) - corr)


def _group_kernel(x_ref, w_ref, s_ref, *rest, bits, group_size, tiles_per_split, num_tiles,
                  unpack, reduce, swap):
    """The per-group forms: the slabs of one group are summed first, and the group's zero and
    scale are applied once to that sum (not once a slab). "dot_group" chains the slabs' MMAs
    into one product; "acc_group" (up to 8 rows) does one float32 FMA a weight on 1 + c/2**bits
    into each row's [SLAB, block_n] sum, so x . (c - z) = 2**bits (x . w' - (1 + z/2**bits) sum x)."""
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    per, tile = 32 // bits, tile_rows(bits)
    span = math.gcd(group_size, tile) // SLAB  # slabs a chunk, all of them in one group
    lo = pl.program_id(2) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)
    bm, bn = o_ref.shape[-2:]
    one_d = len(x_ref.shape) == 1

    def zero_of(g):
        return 2.0 ** (bits - 1) if z_ref is None else z_ref[pl.ds(g, 1), :].astype(jnp.float32)

    def x_rows(k0):  # each row's SLAB columns from k0, float32
        if one_d:
            return [x_ref[pl.ds(k0, SLAB)].astype(jnp.float32)]
        return [x_ref[r, pl.ds(k0, SLAB)].astype(jnp.float32) for r in range(bm)]

    def fma_chunk(words, t, c, accs, corrs):
        g = (t * tile + c * span * SLAB) // group_size
        return fma_group(words, range(c * span, (c + 1) * span), lambda j: x_rows(
            t * tile + j * SLAB), bits, zero_of(g), s_ref[pl.ds(g, 1), :], accs, corrs)

    def mma_chunk(words, t, c, acc):
        g = (t * tile + c * span * SLAB) // group_size
        part = mma_group(words, range(c * span, (c + 1) * span), lambda j: x_ref[
            :, pl.ds(t * tile + j * SLAB, SLAB)], bits, zero_of(g), unpack == "magic", swap)
        return acc + part * _t(s_ref[pl.ds(g, 1), :], swap)

    def body(t, carry):
        words = w_ref[pl.ds(pl.multiple_of(t * SLAB, SLAB), SLAB), :]
        for c in range(per // span):
            carry = (mma_chunk(words, t, c, carry) if reduce == "dot_group"
                     else fma_chunk(words, t, c, *carry))
        return carry

    if reduce == "dot_group":
        acc = lax.fori_loop(lo, hi, body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
        o_ref[...] = (acc.T if swap else acc).astype(o_ref.dtype).reshape(o_ref.shape)
        return
    init = ([jnp.zeros((SLAB, bn), jnp.float32)] * bm, [jnp.zeros((1, bn), jnp.float32)] * bm)
    accs, corrs = lax.fori_loop(lo, hi, body, init)
    for r, (acc, corr) in enumerate(zip(accs, corrs)):
        out = fma_result(acc, corr, bits).astype(o_ref.dtype)
        if one_d:
            o_ref[...] = out.reshape(o_ref.shape)
        else:
            o_ref[pl.ds(r, 1), :] = out


def _t(a, swap: bool):
    """A [1, N] row (or a float) as the swapped product's [N, 1] column."""
    return a.T if swap and hasattr(a, "T") else a


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_m", "block_n",
                                             "num_splits", "num_warps", "num_stages", "unpack",
                                             "reduce", "swap", "interpret"))
def int_matmul_packed(x, words, scale, zero=None, *, bits: int, group_size: int,
                      block_m: int = 16, block_n: int = 128, num_splits: int = 1,
                      num_warps: int = 4, num_stages: int = 3, unpack: str = "convert",
                      reduce: str = "dot", swap: bool = False, interpret: bool = False):
    """x [M_pad, K_pad] (M_pad a multiple of block_m, K padded with zeros) -> [M_pad, N].

    `unpack="magic"` (INT4, bf16 x) makes each code a bf16 by its bit pattern and takes the
    zero off after the dot; "convert" converts int -> f32 -> x's dtype. `reduce="sum"` (up
    to 8 rows, each its own accumulator) multiplies and sums in float32 instead of a padded MMA;
    "acc" keeps each row's products in a [SLAB, block_n] float32 accumulator and sums it once
    after the loop. "dot_group" and "acc_group" are "dot" and "acc" with a group's slabs summed
    before its zero and scale are applied (`_group_kernel`). `swap` computes
    w^T x^T, so the unpacked slab (block_n rows) is the MMA's left operand, as Hopper's
    warpgroup MMA wants, and the few rows of x its narrow right one."""
    m, k_pad = x.shape
    n = words.shape[1]
    block_n = min(block_n, n)
    if unpack not in UNPACKS or reduce not in REDUCES:
        raise ValueError(f"int matmul: unpack={unpack!r} must be one of {UNPACKS}, "
                         f"reduce={reduce!r} one of {REDUCES}")
    if unpack == "magic" and reduce in MMA_REDUCES and (bits != 4 or x.dtype != jnp.bfloat16):
        raise ValueError(f"int matmul: unpack='magic' takes 4 bits and bf16 x, not bits={bits}"
                         f", {x.dtype}")
    if reduce not in MMA_REDUCES and block_m > 8:
        raise ValueError(f"int matmul: reduce={reduce!r} takes block_m <= 8, not {block_m}")
    if m % block_m or n % block_n or k_pad != words.shape[0] * (32 // bits):
        raise ValueError(f"int matmul: x {x.shape} and words {words.shape} do not fit "
                         f"block_m={block_m}, block_n={block_n}, bits={bits}")
    num_tiles = k_pad // tile_rows(bits)
    per_split = -(-num_tiles // num_splits)
    grouped = reduce in ("dot_group", "acc_group")
    kernel = functools.partial(_group_kernel if grouped else _kernel, bits=bits,
                               group_size=group_size, tiles_per_split=per_split,
                               num_tiles=num_tiles, unpack=unpack, reduce=reduce,
                               swap=swap and reduce in MMA_REDUCES)
    groups = scale.shape[0]
    x_block = (None, k_pad) if reduce not in MMA_REDUCES and block_m == 1 else (block_m, k_pad)
    in_specs = [pl.BlockSpec(x_block, lambda i, j, s: (i, 0)),
                pl.BlockSpec((words.shape[0], block_n), lambda i, j, s: (0, j)),
                pl.BlockSpec((groups, block_n), lambda i, j, s: (0, j))]
    args = [x, words, scale]
    if zero is not None:
        in_specs.append(pl.BlockSpec((groups, block_n), lambda i, j, s: (0, j)))
        args.append(zero)
    split = num_splits > 1
    out = pl.pallas_call(
        kernel,
        grid=(m // block_m, n // block_n, num_splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, m, n), jnp.float32 if split else x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int_matmul",
    )(*args)
    return out.sum(0).astype(x.dtype) if split else out[0]


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def splits_for(m: int, n: int, num_tiles: int, block_m: int, block_n: int,
               target_programs: int = 264) -> int:
    """Enough programs to fill the GPU (about two per SM) when the output has few blocks."""
    blocks = -(-m // block_m) * -(-n // block_n)
    return int(max(1, min(target_programs // blocks, num_tiles, 16)))


def params_for(m: int, k_pad: int, n: int, bits: int) -> dict:
    """Tiles for a call: the tuned entry of `tuning.QUANT_MATMUL` for this shape and M where one
    fits, else 128 columns a program, rows in blocks of 16-64, split-K to fill the GPU."""
    from . import tuning
    p = tuning.quant_params("w4a16", m, k_pad, n) if bits == 4 else None
    if p is not None and n % min(p.get("block_n", 128), n) == 0 and (
            p.get("reduce", "dot") in MMA_REDUCES or m <= 8) and (
            p.get("unpack", "convert") == "convert" or bits == 4):
        return p
    return dict(block_n=128)


def int_matmul(x, words, scale, zero=None, perm=None, *, bits: int, group_size: int,
               block_m: int | None = None, block_n: int | None = None,
               num_splits: int | None = None, interpret: bool = False, **compiler):
    """x [..., K] @ the packed weights -> [..., N]. `perm` [K] (act order) gathers x's columns
    into the packed row order first. Rows are padded to the row block, K to the tile."""
    if perm is not None:
        x = x[..., perm]
    lead, k = x.shape[:-1], x.shape[-1]
    k_pad = words.shape[0] * (32 // bits)
    check_group(group_size, k_pad)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    n = words.shape[1]
    if block_n is None:  # nothing named: the tuned tiles (the caller's names override them)
        tuned = params_for(m, k_pad, n, bits)
        block_n, tuned_m = tuned.pop("block_n", 128), tuned.pop("block_m", None)
        block_m = block_m or tuned_m
        num_splits = tuned.pop("num_splits", num_splits) if num_splits is None else num_splits
        compiler = tuned | compiler
    if compiler.get("unpack") == "magic" and x2.dtype != jnp.bfloat16:
        compiler = compiler | dict(unpack="convert")  # its bit patterns are bf16's
    if compiler.get("reduce", "dot") not in MMA_REDUCES:  # each row its own accumulator
        block_m = pl.next_power_of_2(m)
    block_m = block_m or block_m_for(m)
    m_pad = -(-m // block_m) * block_m
    if m_pad != m or k_pad != k:
        x2 = jnp.pad(x2, ((0, m_pad - m), (0, k_pad - k)))
    if num_splits is None:
        num_splits = splits_for(m_pad, n, k_pad // tile_rows(bits), block_m, min(block_n, n))
    y = int_matmul_packed(x2, words, scale, zero, bits=bits, group_size=group_size,
                          block_m=block_m, block_n=block_n, num_splits=num_splits,
                          interpret=interpret, **compiler)
    return y[:m].reshape(*lead, n)
