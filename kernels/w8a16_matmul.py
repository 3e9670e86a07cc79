"""Weight-only quantized matrix product (W8A16, Pallas, Triton lowering).

x [M, K] (bf16) times weights stored as q [K, N] or [N, K] (float8_e4m3fn or int8) with
float32 scales [G, N] (G = 1 per output channel, else one row per group of K // G rows) and
optional zeros. Decode is memory-bound: the weights are read once, in their stored bytes, and
dequantized in registers; the MMA runs in x's dtype with float32 accumulation, or, for up to 8
rows, each row is multiplied and summed on the CUDA cores with its own accumulator (no 16-row
padded MMA). FP8 weights of the model are stored [N, K] (`model/quant.py` k_last): a tile's
rows then run along K, block_k contiguous bytes each.

A program computes one [block_m, block_n] tile of the output over a slice of K: with few output
tiles (a decode step's M of 1..16 and N of 1-14k) K is split over `split_k` programs so every
SM streams weights; their float32 partial sums are added afterwards. Group scales multiply each
block_k step's partial product (block_k divides the group); per-channel scales multiply once at
the end. The jnp reference is `quant_reference.w8a16_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, q_ref, s_ref, *rest, block_k: int, num_k: int, group_k: int,
            has_zero: bool, dot_dtype, reduce: str, swap: bool, nk: bool):
    z_ref, o_ref = rest if has_zero else (None, rest[0])
    grouped = s_ref.shape[0] > 1
    bm, bn = o_ref.shape[-2:]
    # Products are kept "column-major" ([block_n, ...]) where the weight tile is [N, K] (nk)
    # or the MMA is swapped; per-column scales and zeros then come as a column.
    cols = nk if reduce != "dot" else swap
    per_col = lambda a: a.T if cols else a
    # Without an MMA each row has its own accumulator: a row's sums never mix with another's.
    one_d = len(x_ref.shape) == 1

    def row(g, k0):
        x = x_ref[pl.ds(k0, block_k)] if one_d else x_ref[g, pl.ds(k0, block_k)]
        return x.astype(jnp.float32)

    def products(w, k0):
        if reduce == "dot":
            xs = x_ref[:, pl.ds(k0, block_k)]
            dt = xs.dtype if dot_dtype is None else dot_dtype
            w = w.astype(dt)
            if swap:  # out^T = w^T x^T: the weight tile fills the MMA's rows
                return [plgpu.dot(w, xs.astype(dt), trans_a=not nk, trans_b=True)]
            return [plgpu.dot(xs.astype(dt), w, trans_b=nk)]
        w = w.astype(jnp.float32)
        parts = [w * (row(g, k0)[None, :] if nk else row(g, k0)[:, None]) for g in range(bm)]
        if reduce == "sum":
            parts = [jnp.sum(p, axis=1 if nk else 0, keepdims=True) for p in parts]
        return parts

    def body(i, accs):
        k0 = pl.multiple_of(i * block_k, block_k)
        w = q_ref[:, pl.ds(k0, block_k)] if nk else q_ref[pl.ds(k0, block_k), :]
        g = k0 // group_k  # this split's blocks of x, q and scales start at its first group
        if has_zero:
            z = z_ref[pl.ds(g, 1), :].astype(jnp.float32)
            w = w.astype(jnp.float32) - (z.T if nk else z)
        parts = products(w, k0)
        if grouped:
            s = per_col(s_ref[pl.ds(g, 1), :])
            parts = [p * s for p in parts]
        return tuple(a + p for a, p in zip(accs, parts))

    if reduce == "dot":
        shapes = [(bn, bm) if cols else (bm, bn)]
    else:
        wide = block_k if reduce == "acc" else 1
        shapes = [(bn, wide) if nk else (wide, bn)] * bm
    accs = lax.fori_loop(0, num_k, body, tuple(jnp.zeros(sh, jnp.float32) for sh in shapes))
    for g, acc in enumerate(accs):
        if reduce == "acc":  # the sums once, after the loop, not once a tile
            acc = jnp.sum(acc, axis=1 if nk else 0, keepdims=True)
        if not grouped:
            acc = acc * per_col(s_ref[...])
        acc = (acc.T if cols else acc).astype(o_ref.dtype)
        if reduce == "dot" or one_d:
            o_ref[...] = acc.reshape(o_ref.shape)
        else:
            o_ref[pl.ds(g, 1), :] = acc


REDUCES = ("dot", "sum", "acc")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "split_k",
                                             "num_warps", "num_stages", "dot_dtype", "reduce",
                                             "swap", "layout", "interpret"))
def w8a16_matmul(x, q, scale, zero=None, *, block_m: int = 16, block_n: int = 64,
                 block_k: int = 256, split_k: int = 1, num_warps: int = 4, num_stages: int = 4,
                 dot_dtype: str | None = None, reduce: str = "dot", swap: bool = False,
                 layout: str = "kn", interpret: bool = False):
    """x [M, K], q [K, N] (or [N, K] with layout "nk"), scale [G, N] float32, zero [G, N] or
    None -> [M, N] in x's dtype.

    Stored [N, K], a tile's rows run along K: block_k contiguous bytes a row where [K, N]
    reads block_n, and the tile is already the left operand of a swapped MMA.

    `dot_dtype` "float16" runs the MMA in f16 (FP8 -> f16 is one conversion per pair; bf16
    activations are exact in f16 within its range); None: x's dtype. `reduce="sum"` (M <= 8)
    multiplies and sums in float32, each row with its own accumulator, instead of a 16-row
    padded MMA; "acc" keeps each row's products of every tile in a [block_k, block_n] float32
    accumulator and sums it once at the end, so the loop holds no cross-thread reduction. `swap` computes the
    transposed product (w^T x^T), so the weight tile (block_n rows, converted in registers) is
    the MMA's left operand and the few rows of x its narrow right one, as Hopper's warpgroup
    MMA wants (64+ rows on the left)."""
    if layout not in ("kn", "nk"):
        raise ValueError(f"w8a16_matmul: layout {layout!r} is not 'kn' or 'nk'")
    nk = layout == "nk"
    m, k = x.shape
    n = q.shape[0] if nk else q.shape[1]
    groups = scale.shape[0]
    group_k = k // groups
    if reduce not in REDUCES or reduce != "dot" and m > 8:
        raise ValueError(f"w8a16_matmul: reduce={reduce!r} must be one of {REDUCES} "
                         f"('sum' and 'acc' take M <= 8, got M={m})")
    block_m = pl.next_power_of_2(m) if reduce != "dot" else block_m
    block_n, block_k = min(block_n, n), min(block_k, k // split_k, group_k)
    if n % block_n or k % (split_k * block_k) or group_k % block_k:
        raise ValueError(f"w8a16_matmul: N={n} must be a multiple of block_n={block_n}, K={k} "
                         f"of split_k*block_k={split_k}*{block_k}, the group {group_k} of "
                         "block_k")
    mp = -(-m // block_m) * block_m
    x = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    kps = k // split_k
    grouped = groups > 1
    srows = groups // split_k if grouped else 1
    if grouped and groups % split_k:
        raise ValueError(f"w8a16_matmul: {groups} scale groups do not split into {split_k}")
    kernel = functools.partial(_kernel, block_k=block_k, num_k=kps // block_k,
                               group_k=group_k if grouped else k, has_zero=zero is not None,
                               dot_dtype=None if dot_dtype is None else jnp.dtype(dot_dtype),
                               reduce=reduce, swap=swap and reduce == "dot", nk=nk)
    s_spec = pl.BlockSpec((srows, block_n), lambda i, j, s: (s if grouped else 0, j))
    x_block = (None, kps) if reduce != "dot" and block_m == 1 else (block_m, kps)
    in_specs = [pl.BlockSpec(x_block, lambda i, j, s: (i, s)),
                pl.BlockSpec((block_n, kps), lambda i, j, s: (j, s)) if nk else
                pl.BlockSpec((kps, block_n), lambda i, j, s: (s, j)), s_spec]
    args = [x, q, scale]
    if zero is not None:
        in_specs.append(s_spec)
        args.append(zero)
    out_dtype = x.dtype if split_k == 1 else jnp.float32
    out = pl.pallas_call(
        kernel,
        grid=(mp // block_m, n // block_n, split_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, mp, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="w8a16_matmul",
    )(*args)
    out = out[0] if split_k == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return out[:m]


def fits(m: int, k: int, n: int, groups: int, p: dict) -> bool:
    """Whether tiles `p` divide this call (a table entry for another shape may not)."""
    block_n, split = min(p.get("block_n", 64), n), p.get("split_k", 1)
    block_k = min(p.get("block_k", 256), k // split, k // groups)
    return (n % block_n == 0 and k % (split * block_k) == 0 and (k // groups) % block_k == 0
            and (groups == 1 or groups % split == 0)
            and (p.get("reduce", "dot") == "dot" or m <= 8))


def blocks_for(m: int, k: int, n: int, groups: int = 1, num_sms: int = 132,
               layout: str = "kn") -> dict:
    """Tiles for a call: the tuned entry of `tuning.QUANT_MATMUL` for this shape, M and layout
    where one fits, else: one row summed over [N, K] tiles of 32 x 256 (or, [K, N], multiplied
    in [128, 64] tiles), a few rows in one 16-row block (the MMA swapped where the weight is
    [N, K]), K split until about two waves of programs stream the weights; larger M in 64-row
    blocks of 128 columns, no split."""
    from . import tuning
    nk = layout == "nk"
    p = tuning.quant_params("w8a16_nk" if nk else "w8a16", m, k, n)
    if p is not None and fits(m, k, n, groups, p):
        return p
    if m > 16:
        return dict(block_m=64, block_n=128, block_k=64, split_k=1)
    one = m == 1 or nk and m <= 2  # two rows summed one by one still beat a padded MMA
    block_n, block_k = (32 if one else 64, 256) if nk else (64, 128 if one else 256)
    tiles = n // block_n if n % block_n == 0 else 1
    split = 1
    while (tiles * split * 2 <= 2 * num_sms and k % (split * 2 * block_k) == 0
           and k // (split * 2) >= 2 * block_k and (groups == 1 or groups % (split * 2) == 0)):
        split *= 2
    extra = dict(reduce="sum" if nk else "acc") if one else dict(swap=True) if nk else {}
    return dict(block_m=m if one else 16, block_n=block_n, block_k=block_k, split_k=split,
                **extra)
