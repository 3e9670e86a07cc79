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
per output element rather than once per weight.

Split-K: for few rows (decode) the [M, N] output has too few column blocks to fill the GPU, so
`num_splits` programs share each block's K tiles and write f32 partial sums that one XLA
reduction adds. Act-order checkpoints (GPTQ `g_idx`) are sorted by group at load; `perm` then
gathers the activations' columns into the same order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SLAB = 32  # K rows per bit plane of a tile: one dot's depth, and the granule of group sizes
BITS = (4, 8)


def tile_rows(bits: int) -> int:
    """K rows of one packed tile (256 for INT4, 128 for INT8)."""
    return SLAB * (32 // bits)


def padded_k(k: int, bits: int) -> int:
    t = tile_rows(bits)
    return -(-k // t) * t


def check_group(group_size: int, k_pad: int):
    if group_size % SLAB or k_pad % group_size and group_size < k_pad:
        raise ValueError(f"int matmul: group_size={group_size} must be a multiple of {SLAB} "
                         f"(and divide the padded K={k_pad}, or cover it)")


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [K, N] (each < 2**bits) -> int32 words [K_pad // (32 // bits), N], K padded
    with zero codes to a multiple of `tile_rows(bits)`."""
    if bits not in BITS:
        raise ValueError(f"int matmul: bits={bits} is not one of {BITS}")
    codes = np.asarray(codes)
    k, n = codes.shape
    per, k_pad = 32 // bits, padded_k(k, bits)
    full = np.zeros((k_pad, n), np.uint32)
    full[:k] = codes
    planes = full.reshape(k_pad // tile_rows(bits), per, SLAB, n)
    words = np.zeros((k_pad // tile_rows(bits), SLAB, n), np.uint32)
    for j in range(per):
        words |= planes[:, j] << np.uint32(bits * j)
    return words.reshape(k_pad // per, n).view(np.int32)


def pack_groups(a, k_pad: int, group_size: int, fill, dtype):
    """Per-group rows [ceil(K / group_size), N] padded to cover K_pad (`fill` in the new rows)."""
    a = np.asarray(a, dtype)
    rows = -(-k_pad // group_size)
    if a.shape[0] < rows:
        a = np.concatenate([a, np.full((rows - a.shape[0], a.shape[1]), fill, dtype)])
    return a


def pack_weight(codes, scale, zero, *, bits: int, group_size: int):
    """Codes [K, N], scale (and zero, or None) [ceil(K / group_size), N] -> the kernel's arrays:
    (int32 words, f32 scale, bf16 zero or None), padded to the tile. `group_size` is K's
    multiple of SLAB, or >= K for one group per column (channel-wise)."""
    k = codes.shape[0]
    k_pad = padded_k(k, bits)
    group_size = k_pad if group_size >= k else group_size
    check_group(group_size, k_pad)
    scale = pack_groups(scale, k_pad, group_size, 1.0, np.float32)
    if zero is not None:
        zero = jnp.asarray(pack_groups(zero, k_pad, group_size, 0.0, np.float32), jnp.bfloat16)
    return pack(codes, bits), scale, zero, group_size


def unpack(words, bits: int, k: int | None = None):
    """int32 words -> int32 codes [K, N] (the first `k` rows; all K_pad without it)."""
    per, n = 32 // bits, words.shape[-1]
    w = words.reshape(-1, 1, SLAB, n)
    shifts = (jnp.arange(per, dtype=jnp.int32) * bits).reshape(1, per, 1, 1)
    codes = ((w >> shifts) & ((1 << bits) - 1)).reshape(-1, n)
    return codes if k is None else codes[:k]


def dequantize(words, scale, zero, *, bits: int, group_size: int, k: int | None = None):
    """The f32 weight [K, N] that the packed arrays stand for."""
    codes = unpack(words, bits).astype(jnp.float32)
    rows = jnp.arange(codes.shape[0]) // group_size
    z = 2.0 ** (bits - 1) if zero is None else zero.astype(jnp.float32)[rows]
    w = (codes - z) * scale.astype(jnp.float32)[rows]
    return w if k is None else w[:k]


def int_matmul_reference(x, words, scale, zero=None, perm=None, *, bits: int, group_size: int):
    """x [M, K] @ dequantized weights, in f32, -> [M, N] in x's dtype."""
    if perm is not None:
        x = x[..., perm]
    k = x.shape[-1]
    w = dequantize(words, scale, zero, bits=bits, group_size=group_size, k=k)
    y = jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def _kernel(x_ref, w_ref, s_ref, *rest, bits, group_size, tiles_per_split, num_tiles):
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    per, mask, tile = 32 // bits, (1 << bits) - 1, tile_rows(bits)
    lo = pl.program_id(2) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)

    def body(t, acc):
        words = w_ref[pl.ds(t * SLAB, SLAB), :]
        for j in range(per):
            k0 = t * tile + j * SLAB
            g = k0 // group_size
            codes = ((words >> (bits * j)) & mask).astype(jnp.float32)
            zero = 2.0 ** (bits - 1) if z_ref is None else z_ref[pl.ds(g, 1), :].astype(
                jnp.float32)
            w = (codes - zero).astype(x_ref.dtype)  # small integers: exact in bf16
            part = plgpu.dot(x_ref[:, pl.ds(k0, SLAB)], w)
            acc = acc + part * s_ref[pl.ds(g, 1), :]
        return acc

    acc = lax.fori_loop(lo, hi, body, jnp.zeros(o_ref.shape[-2:], jnp.float32))
    o_ref[...] = acc.reshape(o_ref.shape).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_m", "block_n",
                                             "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def int_matmul_packed(x, words, scale, zero=None, *, bits: int, group_size: int,
                      block_m: int = 16, block_n: int = 128, num_splits: int = 1,
                      num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """x [M_pad, K_pad] (M_pad a multiple of block_m, K padded with zeros) -> [M_pad, N]."""
    m, k_pad = x.shape
    n = words.shape[1]
    block_n = min(block_n, n)
    if m % block_m or n % block_n or k_pad != words.shape[0] * (32 // bits):
        raise ValueError(f"int matmul: x {x.shape} and words {words.shape} do not fit "
                         f"block_m={block_m}, block_n={block_n}, bits={bits}")
    num_tiles = k_pad // tile_rows(bits)
    per_split = -(-num_tiles // num_splits)
    kernel = functools.partial(_kernel, bits=bits, group_size=group_size,
                               tiles_per_split=per_split, num_tiles=num_tiles)
    groups = scale.shape[0]
    in_specs = [pl.BlockSpec((block_m, k_pad), lambda i, j, s: (i, 0)),
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


def int_matmul(x, words, scale, zero=None, perm=None, *, bits: int, group_size: int,
               block_m: int | None = None, block_n: int = 128, num_splits: int | None = None,
               interpret: bool = False, **compiler):
    """x [..., K] @ the packed weights -> [..., N]. `perm` [K] (act order) gathers x's columns
    into the packed row order first. Rows are padded to the row block, K to the tile."""
    if perm is not None:
        x = x[..., perm]
    lead, k = x.shape[:-1], x.shape[-1]
    k_pad = words.shape[0] * (32 // bits)
    check_group(group_size, k_pad)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    block_m = block_m or block_m_for(m)
    m_pad = -(-m // block_m) * block_m
    if m_pad != m or k_pad != k:
        x2 = jnp.pad(x2, ((0, m_pad - m), (0, k_pad - k)))
    n = words.shape[1]
    if num_splits is None:
        num_splits = splits_for(m_pad, n, k_pad // tile_rows(bits), block_m, min(block_n, n))
    y = int_matmul_packed(x2, words, scale, zero, bits=bits, group_size=group_size,
                          block_m=block_m, block_n=block_n, num_splits=num_splits,
                          interpret=interpret, **compiler)
    return y[:m].reshape(*lead, n)
