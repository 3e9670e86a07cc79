"""Multi-head latent attention over paged latents (absorbed form), Pallas with the Triton
lowering, and its `jnp` reference.

Per token the pages hold the latent c (L = kv_lora_rank dims) and the RoPE key k_pe (R dims),
in two arrays latent_pages [1, P, page, L] and rope_pages [1, P, page, R] (one "kv head";
L and R stay powers of two, which Triton's tiles need, where L + R = 576 is not). A query
arrives already multiplied into the latent space: q_lat [.., H, L] (q_nope @ w_uk) and q_pe
[.., H, R]. Then score = q_lat . c + q_pe . k_pe and the output is softmax @ c [.., H, L]
(the caller multiplies by w_uv). Every head reads the same keys, as in MQA.

Kernel: one program per (block of `block_h` query heads, query row, split). Its heads' queries
stay on chip while it walks the row's keys in tiles of `block_k` tokens (a slice of one page,
a page, or several pages, looked up in the page table) with an online softmax; the latent tile
serves both as K (with the RoPE tile) and as V. Head blocks are the grid's first axis, so the
programs of one row run side by side and read its latent through L2 nearly once. With
`num_splits` > 1 each program takes a share of the tiles and `paged.merge_splits` combines the
normalized partials by their log-sum-exps (flash-decoding), for few long rows. With
`v_parts` > 1 the output's L columns are split over that many programs of each head block:
each computes the full scores but multiplies and keeps only its columns (a smaller
accumulator, so one warpgroup can hold it).

On Hopper (why the defaults): warpgroup MMAs want >= 64 rows, so `block_h` 64 with 8 warps
(the [64, 512] float32 accumulator split over two warpgroups, 128 registers a thread). Triton's
pipeliner gives the page-table read its own stages, so a latent tile is in flight while the
last is multiplied only with >= 5 stages (3 buffers); at 64-token tiles three buffers and the
queries exceed shared memory, hence 32-token tiles (`smem_bytes` estimates the footprint).
With 8 warps Triton gives the scores' product all warps along its 64 rows (it feeds the
next product), so both warpgroups compute the same scores; `v_parts` 2 with 4 warps is the
alternative (the same total work, spread over twice the programs).

A query row is a decode token (one per sequence) or, for a ragged step, any token with its
own context length and its sequence's page table (`token_rows`): a prefill chunk or a
speculative verify then reads its sequence's latent once per token and multiplies it once per
token, which is correct but costs what that many decode rows cost (no prefill kernel here).

Limits: L, R, page_size, block_k, block_h and v_parts are powers of two (GPU), block_h >= 16
and R >= 16 (Triton's dot); element offsets fit int32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .flash import finish, online_softmax_step
from .paged import _gather, merge_splits
from .reference import NEG_INF, token_sequence_ids

LOG2E = math.log2(math.e)


# -- reference ---------------------------------------------------------------------------------
def ragged_mla_reference(q_lat, q_pe, latent_pages, rope_pages, query_start, context_lens,
                         page_table, *, sm_scale):
    """Mixed prefill chunks and decode tokens on one flat axis, as
    `reference.ragged_paged_attention_reference` lays them out: q_lat [T, H, L], q_pe [T, H, R]
    -> [T, H, L] in q_lat's dtype. Token i of sequence s's chunk sits at position
    context_lens[s] - q_len + i and sees the keys at 0..that position; padding gets zeros."""
    T, S = q_lat.shape[0], page_table.shape[0]
    t = jnp.arange(T)
    seq = jnp.clip(token_sequence_ids(query_start, T), 0, S - 1)
    q_len = query_start[1:] - query_start[:-1]
    in_seq = (t >= query_start[seq]) & (t < query_start[seq + 1])
    pos = jnp.where(in_seq, context_lens[seq] - q_len[seq] + t - query_start[seq], -1)
    gather = lambda pages: pages[0][page_table].reshape(S, -1, pages.shape[-1]).astype(
        jnp.float32)  # [S, keys, dim]
    c, k_pe = gather(latent_pages), gather(rope_pages)
    s = (jnp.einsum("thl,tkl->thk", q_lat.astype(jnp.float32), c[seq])
         + jnp.einsum("thr,tkr->thk", q_pe.astype(jnp.float32), k_pe[seq])) * sm_scale
    visible = (jnp.arange(c.shape[1])[None, :] <= pos[:, None])[:, None, :]  # [T, 1, keys]
    s = jnp.where(visible, s, NEG_INF)
    p = jnp.where(visible, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("thk,tkl->thl", p, c[seq]).astype(q_lat.dtype)


def mla_decode_reference(q_lat, q_pe, latent_pages, rope_pages, context_lens, page_table, *,
                         sm_scale):
    """Decode: row b is sequence b's one token, at position context_lens[b] - 1."""
    starts = jnp.arange(q_lat.shape[0] + 1, dtype=jnp.int32)
    return ragged_mla_reference(q_lat, q_pe, latent_pages, rope_pages, starts, context_lens,
                                page_table, sm_scale=sm_scale)


def token_rows(query_start, context_lens, page_table, num_tokens):
    """A ragged step as decode rows: each token's context length (its position + 1; 0 for
    padding) and its sequence's page table [T, pages_per_seq]."""
    S = page_table.shape[0]
    t = jnp.arange(num_tokens)
    seq = jnp.clip(token_sequence_ids(query_start, num_tokens), 0, S - 1)
    in_seq = (t >= query_start[seq]) & (t < query_start[seq + 1])
    q_len = query_start[1:] - query_start[:-1]
    lens = jnp.where(in_seq, context_lens[seq] - q_len[seq] + t - query_start[seq] + 1, 0)
    return lens.astype(jnp.int32), page_table[seq]


# -- kernel ------------------------------------------------------------------------------------
def smem_bytes(block_h, block_k, kv_lora_rank, rope_dim, num_stages, itemsize=2):
    """An estimate of the kernel's shared memory on Hopper: the queries and the pipeline's
    latent + RoPE tiles; Triton keeps max(2, (num_stages + 1) // 2) tiles (the page-table read
    takes the other stages)."""
    tiles = max(2, (num_stages + 1) // 2)
    return (block_h + tiles * block_k) * (kv_lora_rank + rope_dim) * itemsize


def _kernel(ctx_ref, pt_ref, qn_ref, qr_ref, lat_ref, rope_ref, *out_refs, sm_scale,
            num_heads, block_h, block_k, v_parts, pages_per_seq, max_keys, num_splits):
    hb, part = pl.program_id(0) // v_parts, pl.program_id(0) % v_parts
    b, split = pl.program_id(1), pl.program_id(2)
    L, R = qn_ref.shape[-1], qr_ref.shape[-1]
    Lv = L // v_parts  # this program's output columns: latent block `part`
    page_size = lat_ref.shape[1]
    head = hb * block_h + jnp.arange(block_h)
    row_ok = head < num_heads
    rows = b * num_heads + head  # q and the output are [rows * H, dim]
    # The latent's column blocks, this program's first; the scores need all of them.
    starts = [((part + i) % v_parts) * Lv for i in range(v_parts)]
    col_blocks = [start + jnp.arange(Lv) for start in starts]
    q_lat = [plgpu.load(qn_ref.at[_gather(rows[:, None], cols[None, :])],
                        mask=row_ok[:, None], other=0.0) for cols in col_blocks]
    q_pe = plgpu.load(qr_ref.at[_gather(rows[:, None], jnp.arange(R)[None, :])],
                      mask=row_ok[:, None], other=0.0)
    ctx = jnp.minimum(ctx_ref[b], max_keys)
    scale = sm_scale * LOG2E  # base-2 logits

    def keys(j):
        """Tile j's latent column blocks [block_k, Lv] and RoPE key [block_k, R]."""
        if block_k <= page_size:  # one page or a slice of one: a scalar page-table read
            tok = j * block_k
            page = pt_ref[b * pages_per_seq + tok // page_size]
            toks = slice(None) if block_k == page_size else pl.ds(tok % page_size, block_k)
            lat = [lat_ref[page, toks, pl.ds(start, Lv)] if v_parts > 1 else lat_ref[page, toks]
                   for start in starts]
            return lat, rope_ref[page, toks]
        n = block_k // page_size  # several pages: a gathered tile
        pidx = j * n + jnp.arange(n)
        pages = plgpu.load(pt_ref.at[pl.ds(b * pages_per_seq + j * n, n)],
                           mask=pidx * page_size < ctx, other=0)
        at = lambda cols: _gather(pages[:, None, None], jnp.arange(page_size)[None, :, None],
                                  cols[None, None, :])
        lat = [lat_ref[at(cols)].reshape(block_k, Lv) for cols in col_blocks]
        return lat, rope_ref[at(jnp.arange(R))].reshape(block_k, R)

    def tile(j, carry, masked):
        lat, k_pe = keys(j)
        lat = [c.astype(q.dtype) for c, q in zip(lat, q_lat)]
        s = plgpu.dot(q_pe, k_pe.astype(q_pe.dtype), trans_b=True)
        for q, c in zip(q_lat, lat):
            s += plgpu.dot(q, c, trans_b=True)
        s, v = s * scale, lat[0]
        mask = None
        if masked:  # the row's last tile: keys past its context are stale or another's
            cols = j * block_k + jnp.arange(block_k)
            mask = jnp.broadcast_to((cols < ctx)[None, :], s.shape)
            v = jnp.where((cols < ctx)[:, None], v, jnp.zeros_like(v))
        return online_softmax_step(s, mask, v, carry)

    n_tiles = pl.cdiv(ctx, block_k)
    share = pl.cdiv(n_tiles, num_splits)
    lo = jnp.minimum(split * share, n_tiles)
    hi = jnp.minimum(lo + share, n_tiles)
    full = jnp.clip(ctx // block_k, lo, hi)  # tiles [lo, full) hold only live keys
    carry = (jnp.zeros((block_h, Lv), jnp.float32), jnp.full((block_h,), NEG_INF, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    carry = lax.fori_loop(lo, full, functools.partial(tile, masked=False), carry)
    o, m, l = lax.fori_loop(full, hi, functools.partial(tile, masked=True), carry)
    o, m, l = finish(o, m, l, None)
    at = _gather(rows[:, None], col_blocks[0][None, :])
    plgpu.store(out_refs[0].at[at], o.astype(out_refs[0].dtype), mask=row_ok[:, None])
    if num_splits > 1:  # base-2 log-sum-exp of this split (the same in every part); empty
        # splits weigh nothing
        lse = jnp.where(l == 0.0, NEG_INF, m + jnp.log2(jnp.where(l == 0.0, 1.0, l)))
        plgpu.store(out_refs[1].at[rows], lse, mask=row_ok)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_h", "block_k", "v_parts", "num_splits", "num_warps", "num_stages",
    "interpret"))
def mla_decode(q_lat, q_pe, latent_pages, rope_pages, context_lens, page_table, *, sm_scale,
               block_h=64, block_k=32, v_parts=1, num_splits=1, num_warps=8, num_stages=5,
               interpret=False):
    """q_lat [B, H, L], q_pe [B, H, R], latent_pages [1, P, page, L], rope_pages [1, P, page,
    R], context_lens [B], page_table [B, pages_per_seq] -> [B, H, L] in q_lat's dtype.
    `block_k` tokens a key tile (None: a page)."""
    B, H, L = q_lat.shape
    R = q_pe.shape[-1]
    KV, P, page_size, _ = latent_pages.shape
    pages_per_seq = page_table.shape[1]
    if KV != 1 or rope_pages.shape != (1, P, page_size, R):
        raise ValueError(f"latent pages {latent_pages.shape} and rope pages {rope_pages.shape} "
                         f"must be [1, pages, page_size, L] and [1, pages, page_size, {R}]")
    block_k = block_k or page_size
    for name, x in (("kv_lora_rank", L), ("qk_rope_head_dim", R), ("page_size", page_size),
                    ("block_k", block_k), ("block_h", block_h), ("v_parts", v_parts)):
        if x & (x - 1):
            raise ValueError(f"{name} {x} must be a power of two")
    max_keys = pages_per_seq * page_size
    if block_k > page_size:  # whole tiles of pages: pad the table, the padding is never live
        page_table = jnp.pad(page_table, ((0, 0), (0, -pages_per_seq % (block_k // page_size))))
        pages_per_seq = page_table.shape[1]
    if v_parts > L:
        raise ValueError(f"v_parts {v_parts} exceeds kv_lora_rank {L}")
    grid = (pl.cdiv(H, block_h) * v_parts, B, num_splits)
    whole = lambda *shape: pl.BlockSpec(shape, lambda h, b, sp: (0,) * len(shape))
    pages = lambda d: pl.BlockSpec((None, P, page_size, d), lambda h, b, sp: (0, 0, 0, 0))
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B * H, L), q_lat.dtype)]
        out_specs = [whole(B * H, L)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, B * H, L), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, B * H), jnp.float32)]
        out_specs = [pl.BlockSpec((None, B * H, L), lambda h, b, sp: (sp, 0, 0)),
                     pl.BlockSpec((None, B * H), lambda h, b, sp: (sp, 0))]
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, num_heads=H, block_h=block_h, block_k=block_k,
        v_parts=v_parts, pages_per_seq=pages_per_seq, max_keys=max_keys, num_splits=num_splits)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(B), whole(B * pages_per_seq), whole(B * H, L), whole(B * H, R),
                  pages(L), pages(R)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pallasite_mla_decode",
    )(context_lens.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1),
      q_lat.reshape(B * H, L), q_pe.reshape(B * H, R), latent_pages, rope_pages)
    if num_splits == 1:
        return outs[0].reshape(B, H, L)
    return merge_splits(*outs, B * H, q_lat.dtype, interpret=interpret).reshape(B, H, L)
