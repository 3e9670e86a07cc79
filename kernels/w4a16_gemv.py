"""Few-row integer products on the Hopper layout's words (W4A16, W8A16; Pallas, Triton lowering).

A decode step of a few rows is a matrix-vector product: all it must do is read the weight once,
at the speed HBM gives it. Here the words of `w4a16_mgpu.pack_t` ([N, K_pad // per] int32; a K
tile is SLAB words of a column, bit plane j of them holding the tile's rows j * SLAB ...) are
read along K: each of a program's block_n columns is one contiguous run of words a step, T tiles
long. A code at bit p of its word becomes a float without an integer conversion (a quarter-rate
instruction on Hopper) and without a shift: one LOP3 masks it in place into the mantissa under
1.0's exponent, 1 + u * 2**(p - 23), and subtracting 1 leaves u * 2**(p - 23) exactly. x comes
float32, each bit plane's scaled by 2**(23 - p) (exact), so one FMA a weight and row adds u * x.
The scale and zero come once per group and column,

    sum (u - z) * s * x  =  s * (sum u * x  -  z * sum x),

with the groups' sums of x made before the kernel. The planes past the mantissa's bits take
the word shifted once. (`unpack="one_plus"`: the code shifted under the exponent's bits, v =
1 + u / 2**bits, with 2**bits * sum v * x - (2**bits + z) * sum x; a shift, an AND and an OR a
code.) No MMA: each row has its own float32 accumulator, [block_n, T, SLAB], summed once after
the loop. With `num_splits` > 1 that many programs share a column block's K tiles and write
float32 partial sums that XLA adds.

The reference is `w4a16_mgpu.dequantize_t` (the same codes through `w4a16_matmul`'s); measured
against the Hopper MMA kernel, bf16 and torch's tinygemm in `benchmarks/bench_w4a16_mgpu.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .w4a16_matmul import F32_ONE, one_plus
from .w4a16_mgpu import SLAB, tile_rows

MAX_ROWS = 8  # each row costs an FMA a weight: past a few rows the MMA kernel is the faster


def fma(a, b, c, *, asm: bool):
    """a * b + c in float32. `asm`: one fma.rn.f32 by inline PTX, since the Triton lowering
    here emits a separate multiply and add (Nsight Compute counts no fused FP32 instruction in
    the kernel without it); interpret mode has no PTX."""
    if not asm:
        return a * b + c
    b, c = jnp.broadcast_to(b, a.shape), jnp.broadcast_to(c, a.shape)
    [out] = plgpu.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def lop3(a, mask: int, bits: int, *, asm: bool):
    """(a & mask) | bits, one LOP3 by inline PTX: ptxas keeps the AND and the OR of two
    constants as two instructions."""
    if not asm:
        return (a & mask) | bits
    [out] = plgpu.elementwise_inline_asm(
        f"lop3.b32 $0, $1, {mask}, {bits}, 0xEA;", args=[a], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return out


def plane_place(j: int, bits: int) -> tuple[bool, int]:
    """Where bit plane j's codes sit for `masked_plane`: in the words shifted down by
    `high_shift` (the planes in the exponent's bits), and from which bit."""
    p = bits * j
    return (True, p - high_shift(bits)) if p + bits > 23 else (False, p)


def high_shift(bits: int) -> int:
    return bits * ((23 - bits) // bits + 1)


def masked_plane(words, high, j: int, bits: int, *, asm: bool):
    """Bit plane j's codes u as float32 u * 2**(p - 23): each code masked in place into the
    mantissa under 1.0's exponent (one LOP3), less 1 (exact). Times x * 2**(23 - p), exact,
    that is u * x. No shift a code: `high` holds the words shifted once."""
    shifted, p = plane_place(j, bits)
    v = lop3(high if shifted else words, ((1 << bits) - 1) << p, F32_ONE, asm=asm)
    return lax.bitcast_convert_type(v, jnp.float32) - 1.0


def _kernel(x_ref, xs_ref, w_ref, s_ref, *rest, bits, group_size, tiles_step, steps, asm):
    z_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    per, tile = 32 // bits, tile_rows(bits)
    rows, t = x_ref.shape[0], tiles_step
    planes = min(per, group_size // SLAB)  # bit planes under one scale
    per_tile = group_size <= tile  # scales indexed [tile, chunk]
    # With `xs_ref` (the sums of x a chunk; x comes float32, plane j's times 2**(23 - p)):
    # sum (u - z) * s * x = s * (sum u * x - z * sum x), u * x from `masked_plane`. Without:
    # v = 1 + u / 2**bits (`one_plus`, a shift a code) and the identity of the docstring.
    mask = xs_ref is not None
    lead = 1.0 if mask else 2.0 ** bits

    def group_vec(ref, t0, c):
        """A chunk's scales (or zeros), [block_n, T, 1], or [block_n, 1, 1] where one group
        spans the step."""
        if per_tile:
            v = ref[pl.ds(t0, t), c, :]
        else:
            v = ref[pl.ds((t0 * tile) // group_size, 1), 0, :]
        return v.astype(jnp.float32).T[:, :, None]

    def body(i, carry):
        accs, zaccs = map(list, carry)
        t0 = pl.multiple_of(i * t, t)
        words = w_ref[:, pl.ds(t0, t), :]
        high = words >> high_shift(bits) if mask else None
        for c in range(per // planes):
            parts, xsums = [0.0] * rows, [0.0] * rows
            for j in range(c * planes, (c + 1) * planes):
                v = (masked_plane(words, high, j, bits, asm=asm) if mask
                     else one_plus(words, j, bits))
                for r in range(rows):
                    xj = x_ref[r, pl.ds(t0, t), j, :].astype(jnp.float32)
                    parts[r] = fma(v, xj[None], parts[r], asm=asm)
                    if not mask:
                        xsums[r] = xsums[r] + xj
            s = group_vec(s_ref, t0, c)
            z = 2.0 ** (bits - 1) if z_ref is None else group_vec(z_ref, t0, c)
            b = -(z if mask else lead + z) * s  # the zero's share, times the chunk's sum of x
            for r in range(rows):
                accs[r] = fma(parts[r], s, accs[r], asm=asm)
                xsum = (xs_ref[r, pl.ds(t0, t), c] if mask
                        else jnp.sum(xsums[r], axis=1))
                zaccs[r] = zaccs[r] + b * xsum[None, :, None]
        return tuple(accs), tuple(zaccs)

    bn = w_ref.shape[0]
    init = (tuple(jnp.zeros((bn, t, SLAB), jnp.float32) for _ in range(rows)),
            tuple(jnp.zeros((bn, t, 1), jnp.float32) for _ in range(rows)))
    accs, zaccs = lax.fori_loop(0, steps, body, init)
    for r in range(rows):
        acc = lead * jnp.sum(jnp.sum(accs[r], axis=2), axis=1)
        o_ref[r, :] = (acc + jnp.sum(jnp.sum(zaccs[r], axis=2), axis=1)).astype(o_ref.dtype)


def plan(tiles: int, group_tiles: int, tiles_step: int, num_splits: int) -> tuple[int, int]:
    """(splits, tiles a step) that divide K's tiles, with a split's range whole groups (or
    inside one) and a step inside one group. `group_tiles`: K tiles a group (0: under one)."""
    def fits(s):
        span = tiles // s
        return tiles % s == 0 and (group_tiles <= 1 or span % group_tiles == 0
                                   or group_tiles % span == 0)
    splits = max(s for s in range(1, num_splits + 1) if fits(s))
    span = tiles // splits
    step = max(1, min(tiles_step, span))
    while span % step or (group_tiles > 1 and group_tiles % step) or step & (step - 1):
        step -= 1  # a power of two (Triton's arrays), dividing the span and the group
    return splits, step


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_n", "tiles_step",
                                             "num_splits", "num_warps", "num_stages", "fused",
                                             "unpack", "interpret"))
def int_gemv_t(x, words_t, scale, zero=None, *, bits: int, group_size: int, block_n: int = 64,
               tiles_step: int = 4, num_splits: int = 1, num_warps: int = 4, num_stages: int = 1,
               fused: bool = True, unpack: str = "mask", interpret: bool = False):
    """x [M, K] (M <= MAX_ROWS) times the packed weight (words_t [N, K_pad // per], scale
    [G, N] f32, zero [G, N] or None: symmetric) -> [M, N] in x's dtype. `fused`: the products'
    multiply-adds by inline PTX (`fma`); `num_stages`: Triton's software pipeline depth;
    `unpack`: how codes become floats, "mask" (`masked_plane`) or "one_plus" (`one_plus`)."""
    if unpack not in ("mask", "one_plus"):
        raise ValueError(f"w4a16_gemv: unpack {unpack!r} is not 'mask' or 'one_plus'")
    m, k = x.shape
    n, kw = words_t.shape
    per, tile = 32 // bits, tile_rows(bits)
    k_pad, tiles = kw * per, kw // SLAB
    group = min(group_size, k_pad)
    if n % block_n or not supported(m, n, bits=bits, group_size=group, k_pad=k_pad):
        raise ValueError(f"w4a16_gemv: M={m} (at most {MAX_ROWS}), N={n} (block_n={block_n}) "
                         f"or group_size={group_size} (K tiles of {tile}) does not fit")
    splits, step = plan(tiles, group // tile, tiles_step, num_splits)
    span = tiles // splits
    x4 = jnp.pad(x, ((0, 0), (0, k_pad - k))).reshape(m, tiles, per, SLAB)
    sums = None
    if unpack == "mask":  # x float32, plane j's times 2**(23 - p) (exact); its chunks' sums
        planes = min(per, group // SLAB)
        x4 = x4.astype(jnp.float32)
        sums = jnp.sum(x4.reshape(m, tiles, per // planes, planes * SLAB), axis=-1)
        e = jnp.asarray([2.0 ** (23 - plane_place(j, bits)[1]) for j in range(per)])
        x4 = x4 * e[:, None]
    chunks = max(1, tile // group)  # groups a tile
    s3 = scale.reshape(-1, chunks, n)
    if group <= tile:
        s_block, s_index = (span, chunks, block_n), lambda j, s: (s, 0, j)
    else:  # a split's groups, or the one group a split lies in
        g_rows = max(1, span * tile // group)
        s_block = (g_rows, 1, block_n)
        s_index = lambda j, s: ((s * span * tile // group) // g_rows, 0, j)
    in_specs = [pl.BlockSpec((m, span, per, SLAB), lambda j, s: (0, s, 0, 0)),
                None if sums is None else pl.BlockSpec((m, span, sums.shape[-1]),
                                                       lambda j, s: (0, s, 0)),
                pl.BlockSpec((block_n, span, SLAB), lambda j, s: (j, s, 0)),
                pl.BlockSpec(s_block, s_index)]
    args = [x4, sums, words_t.reshape(n, tiles, SLAB), s3]
    if zero is not None:
        in_specs.append(pl.BlockSpec(s_block, s_index))
        args.append(zero.reshape(-1, chunks, n))
    out_dtype = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, bits=bits, group_size=group, tiles_step=step,
                          steps=span // step, asm=fused and not interpret),
        grid=(n // block_n, splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w4a16_gemv",
    )(*args)
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)


def blocks_for(m: int, n: int, tiles: int, num_sms: int = 132) -> dict:
    """Tiles for an [m, K] x [K, n] call (swept on the H100 at 8B layer shapes, one row,
    benchmarks/bench_w4a16_mgpu.py): 64 columns and four K tiles a program (K split to match),
    two tiles a step, or four where the columns alone give two programs an SM; four warps."""
    bn = next(b for b in (64, 32, 16) if n % b == 0 or b == 16)
    step = 4 if n // bn >= 2 * num_sms else 2
    return dict(block_n=bn, tiles_step=step, num_splits=max(1, tiles // 4), num_warps=4)


def supported(m: int, n: int, *, bits: int, group_size: int, k_pad: int) -> bool:
    """Whether the kernel tiles this call: up to MAX_ROWS rows, groups that tile K's tiles (or
    whole tiles), N in 16s."""
    tile, group = tile_rows(bits), min(group_size, k_pad)
    return (bits in (4, 8) and 1 <= m <= MAX_ROWS and n % 16 == 0 and group % SLAB == 0
            and (tile % group == 0 if group < tile else group % tile == 0)
            and k_pad % group == 0)


def int_matmul(x, words_t, scale, zero=None, perm=None, *, bits: int, group_size: int,
               interpret: bool = False, **blocks):
    """x [M, K] times the packed weight with words transposed ([N, K_pad // per]) -> [M, N]."""
    if perm is not None:
        x = x[..., perm]
    tiles = words_t.shape[1] // SLAB
    kw = blocks_for(x.shape[0], words_t.shape[0], tiles) | blocks
    return int_gemv_t(x, words_t, scale, zero, bits=bits, group_size=group_size,
                      interpret=interpret, **kw)
