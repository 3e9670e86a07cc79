"""Batch-invariant matrix product (Pallas, Triton lowering).

x [M, K] times w [K, N] (or [N, K], layout "nk") -> [M, N], where every output row comes out the
same bits whatever M is. XLA picks a GEMM per shape (its tiles, split-K and instruction follow M),
so a row's sums change order with the batch around it: a plain decode step in an 8-token bucket
and the same step in a 2-token bucket differ by about 1e-2 in bf16 on an H100, and greedy
argmaxes at near-ties flip. Speculative verification, which scores 1 + k tokens of a sequence
in one step, then cannot give plain decoding's tokens.

Here the order of the sums is fixed by K alone. K is cut into segments (their length a function
of K); each segment is summed over K tiles into a float32 accumulator that starts at zero, and
the segments' sums are added in order: ((s0 + s1) + s2) + ... Few rows run one segment a program
(split-K, so the weights stream through every SM) and add the partial sums afterwards in that
order; many rows run the segments one after the other inside a program. Either way a row meets
the same chain of warpgroup MMAs (block_m is at least 64), each adding a 16-deep product into the
accumulator, so tile sizes leave the bits alone: rows of calls with M from 1 to 8192, tiles from
[64, 64] to [128, 256] and K steps of 64 or 128 came out bit for bit equal on the H100
(`benchmarks/invariance.py`). Rows past M are zero padding: with masked loads of a short row
block instead, a decode-sized call gave other bits there. The jnp reference is a plain
float32-accumulated matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_K = 64


def segment_k(k: int) -> int:
    """The length of K's segments: 1024 where it divides K, else the largest power of two from
    512 down to BLOCK_K that does; 0 where none does (the kernel does not take such a K)."""
    return next((seg for seg in (1024, 512, 256, 128, BLOCK_K) if k % seg == 0), 0)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, seg_k: int, segments: int, nk: bool,
            flat: bool):
    bm, bn = o_ref.shape[-2:]
    zeros = jnp.zeros((bm, bn), jnp.float32)
    steps = seg_k // block_k

    def product(k0):
        x = x_ref[:, pl.ds(k0, block_k)]
        w = w_ref[:, pl.ds(k0, block_k)] if nk else w_ref[pl.ds(k0, block_k), :]
        return plgpu.dot(x, w, trans_b=nk)

    if flat:  # one loop over K: a segment's sum joins the total at the segment's last tile
        def body(i, carry):
            total, acc = carry
            acc = acc + product(pl.multiple_of(i * block_k, block_k))
            end = lax.rem(i + 1, steps) == 0
            return jnp.where(end, total + acc, total), jnp.where(end, zeros, acc)
        total, _ = lax.fori_loop(0, segments * steps, body, (zeros, zeros))
    else:
        def segment(s):
            return lax.fori_loop(0, steps, lambda i, acc: acc + product(
                pl.multiple_of(s * seg_k + i * block_k, block_k)), zeros)
        total = segment(0)
        for s in range(1, segments):  # in order, as the split-K partial sums are added
            total = total + segment(s)
    o_ref[...] = total.reshape(o_ref.shape).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "split", "flat",
                                             "num_warps", "num_stages", "layout", "out_dtype",
                                             "interpret"))
def invariant_matmul(x, w, *, block_m: int = 64, block_n: int = 128, block_k: int = BLOCK_K,
                     split: bool = True, flat: bool = False, num_warps: int = 4,
                     num_stages: int = 4, layout: str = "kn", out_dtype=None,
                     interpret: bool = False):
    """x [M, K], w [K, N] (or [N, K] with layout "nk") -> [M, N] in `out_dtype` (x's dtype by
    default). `split`: a program per segment and the partial sums added after (few rows);
    otherwise a program runs all segments (`flat`: in one loop) (many rows). The result's bits
    do not depend on M, `split`, `flat` or the tiles; block_m is 64 or more, so every M takes
    the same MMA."""
    if layout not in ("kn", "nk"):
        raise ValueError(f"invariant_matmul: layout {layout!r} is not 'kn' or 'nk'")
    if block_m < 64:
        raise ValueError(f"invariant_matmul: block_m={block_m} under 64 would take another MMA")
    nk = layout == "nk"
    m, k = x.shape
    n = w.shape[0] if nk else w.shape[1]
    if (w.shape[1] if nk else w.shape[0]) != k:
        raise ValueError(f"invariant_matmul: x {x.shape} and w {w.shape} ({layout}) differ in K")
    seg_k = segment_k(k)
    block_n = min(block_n, n)
    if n % block_n or not seg_k or seg_k % block_k:
        raise ValueError(f"invariant_matmul: N={n} is not a multiple of block_n={block_n}, or "
                         f"K={k} of {block_k}")
    segments = k // seg_k
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    # Padded, not masked: with masked loads of a short last row block the H100 gave other bits.
    mp = -(-m // block_m) * block_m
    x = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    split = split and segments > 1
    kseg = seg_k if split else k  # K a program sees
    kernel = functools.partial(_kernel, block_k=block_k, seg_k=seg_k,
                               segments=1 if split else segments, nk=nk, flat=flat)
    parts = segments if split else 1
    out = pl.pallas_call(
        kernel,
        grid=(mp // block_m, n // block_n, parts),
        in_specs=[pl.BlockSpec((block_m, kseg), lambda i, j, s: (i, s)),
                  pl.BlockSpec((block_n, kseg), lambda i, j, s: (j, s)) if nk else
                  pl.BlockSpec((kseg, block_n), lambda i, j, s: (s, j))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((parts, mp, n), jnp.float32 if split else out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="invariant_matmul",
    )(x, w)
    total = out[0]
    for s in range(1, parts):  # one add at a time: the order the loop kernel adds them in
        total = total + out[s]
    return total[:m].astype(out_dtype)


def takes(k: int, n: int) -> bool:
    """Whether the kernel takes a [K, N] weight: K in whole 64-tiles, N in whole 16 columns."""
    return segment_k(k) > 0 and n % 16 == 0


def blocks_for(m: int, k: int, n: int) -> dict:
    """Tiles and mode for a call (the bits stay the same: see the module doc). H100, 2026-11-26
    (`benchmarks/invariance.py --sweep`, Llama-3-8B shapes): up to 64 rows, [64, 64] tiles and
    split-K (1.0-1.25x XLA's time); to 256, [64, 128] (1.5-2.2x); above, [128, 128] tiles with
    128-deep K steps in one loop (2.0x: about 400 TFLOP/s against XLA's 800)."""
    if m > 256:
        p = dict(block_m=128, block_n=128, block_k=128, split=False, flat=True, num_warps=8,
                 num_stages=3)
    else:
        p = dict(block_m=64, block_n=64 if m <= 64 else 128, split=True, num_warps=4,
                 num_stages=3 if m <= 64 else 4)
    while n % p["block_n"] and p["block_n"] > 16:
        p["block_n"] //= 2
    if segment_k(k) % p.get("block_k", BLOCK_K):
        p["block_k"] = BLOCK_K
    return p


def reference(x, w, *, layout: str = "kn", out_dtype=None):
    w = w.T if layout == "nk" else w
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
