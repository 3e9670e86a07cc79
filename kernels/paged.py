"""Ragged paged attention (mixed prefill chunks and decode tokens) and paged decode attention,
Pallas with the Triton lowering.

One kernel serves both. The flat token axis is cut into blocks of `block_rows // G` tokens that
never cross a sequence (G = H // KV, the query heads that share one kv head). A program owns one
block, one kv head and one split of the keys: its `block_rows` query rows are the block's tokens
times the G heads of the group, gathered from q [T * H, D] where they lie (and the output written
back the same way, so no transpose surrounds the launch), so each K/V page is read from HBM once
for the whole group. Keys come in tiles of `pages_per_block` pages looked
up in the page table; tiles wholly below the block's first causal position run without a mask.

Split-K (flash-decoding): with `num_splits` > 1, a program takes an even share of its block's key
tiles and writes a normalized partial output and its log-sum-exp; `merge_splits` merges them in
one more launch. Batch 1 with a long context then still fills the GPU. With `split_tiles` a
split takes that many tiles from a fixed boundary instead, so a row's sums never depend on the
other rows of its block or on the call's number of splits: it is batch-invariant.

Block metadata (which sequence and first token each block has) is computed with jnp from
query_start, with a static upper bound of cdiv(T, tokens_per_block) + S blocks; the blocks past
the real ones write zeros for the tokens past query_start[-1], so no select follows the launch.
Decode (one token per sequence) needs no metadata: block b is sequence b, so the call is the
kernel alone (plus the merge with splits); each XLA op around a launch costs ~2-3 us, a
twentieth of a batch-1 32k decode. In a ragged call the blocks of the leading one-token
sequences (a step packs its decode rows first) run the decode branch too, waiting on no
metadata, and the blocks past the last token below T (the padding of a step's bucket) return
after one load.

Options: with `sliding_window` W a block's keys start at the page holding its first token's
first visible key (position - W + 1): pages wholly outside the window are neither in a tile nor
in a split's share, so they are never read and hold anything. The tiles that the window's edge
crosses run masked (and no V rows are zeroed there: those keys are real, if old).
`logit_softcap` and `sinks` as in `flash.py`; with splits, split 0 carries the sink.
Quantized pages (float8_e4m3fn) come with per-KV-head float32 `k_scale`/`v_scale`: a program
owns one kv head, so K's scale joins the score scale (one multiply of the score tile, which
the softmax scale needs anyway) and V's multiplies the output once; no K or V tile is ever
scaled. Their V pages are keys-last, [KV, P, D, page_size] (`reference.keys_last`): a tile
loads as [D, keys], and after its conversion a register transpose makes it P V's right operand.
Stored [page_size, D], the converted tile went back through shared memory to become that
operand (and the kernel took 1.43x the time at 200 rows of 400 keys on the H200). `fp8_dot`
says how float8 tiles meet q:
- "q": converted to q's dtype (bf16) for the tensor cores. e4m3 -> bf16 has no instruction of
  its own on sm_90 (it goes through f16 and f32 there), and the converted tile goes back through
  shared memory for the MMA.
- "f16": converted to f16 (one `cvt.rn.f16x2.e4m3x2` per two values on sm_89+), q and P in
  f16 too, so the MMAs run in f16 with float32 accumulation. f16 holds q (|q| < 65504) and P
  (in [0, 1]) with more mantissa than bf16.
- "f16_swap": f16 as above, with the MMAs transposed: S^T = K q^T and O^T = V^T P^T, so the
  converted K and V tiles are the MMA's left operand, which Hopper's warpgroup MMA may take
  from registers (the right one always comes from shared memory); "f16_swap_qk" swaps only
  q K^T.
- "fma": no MMA: q K^T and P V as float32 products and sums on the CUDA cores, the tiles
  converted e4m3 -> f16 -> f32 in registers as loaded. A decode program has only G = H / KV
  live rows (4 for Llama-3-8B), which the MMAs pad to 16 or 64; here `block_rows` may be as
  small as G, so no padded row is computed. Keep tiles small (product [rows, keys, D] lives in
  registers): rows * block_k * D / (32 * num_warps) values a thread.
- "e4m3": q K^T on the float8 tensor cores, K's tiles as stored (never converted): q is
  split into two e4m3 terms with per-row scales, hi + lo, which together hold about as many
  mantissa bits as bf16, and the two products are summed with their scales. V's tiles go the
  "f16" way.
- "fma_rows": the same products one row at a time, as 2-D [keys, D] operations on the tiles
  as loaded (q's row broadcast over the keys, P's row over D), so the big tiles keep the layout
  of their loads and only [rows, keys] and [rows, D] values change layout; rows passes a tile.
Bfloat16 pages ignore `fp8_dot`.

Limits: page_size, block_rows and pages_per_block are powers of two, head_dim too; element
offsets must fit int32 (KV * num_pages * page_size * D and T * H * D < 2**31).
What bounds decode: one pass over K/V at HBM speed is the floor; tile loads go through the page
table, so each tile costs a dependent index load first, hidden by num_stages pipelining. On the
H100 that reaches 100%-102% of the copy ceiling from half a gigabyte per call (batch 64 at 4k:
0.361 ms against 0.356 for an XLA reduction reading the same bytes contiguously) and 80% at
batch 1 with a 32k context, where 16 splits of 2048 keys give one program per SM
(docs/kernels_notes.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .flash import base2_logits, finish, online_softmax_step, scores
from .quant_reference import FP8_MAX
from .reference import NEG_INF, head_scale, keys_last

LOG2E = math.log2(math.e)


def block_metadata(query_start, tokens_per_block, num_blocks, total=None):
    """For each block: its sequence and first token. Blocks past the last real one get
    sequence S (none) and, in turn, the padding tokens from query_start[-1] on, whose rows the
    kernel zeroes; cdiv(T, tokens_per_block) + S blocks always reach the last of T tokens.
    With `total` (T) also [the count of blocks with a token below T (the real ones first), the
    count of leading sequences of one token (block b is then sequence b and token b)]."""
    S = query_start.shape[0] - 1
    q_len = query_start[1:] - query_start[:-1]
    n_blk = (q_len + tokens_per_block - 1) // tokens_per_block
    ends = jnp.cumsum(n_blk)
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # All pairs compared is one fusion; searchsorted's default method is a device loop of
    # ~log2(S) steps, each several kernels and copies (a tenth of a mixed call on the H100).
    seq = jnp.searchsorted(ends, b, side="right", method="compare_all")
    seq = jnp.minimum(seq, S - 1).astype(jnp.int32)
    tok = query_start[seq] + (b - (ends[seq] - n_blk[seq])) * tokens_per_block
    valid = b < ends[-1]
    pad_tok = query_start[-1] + (b - ends[-1]) * tokens_per_block
    out = jnp.where(valid, seq, S), jnp.where(valid, tok, pad_tok).astype(jnp.int32)
    if total is None:
        return out
    pad = jnp.maximum(total - query_start[-1], 0)
    live = jnp.minimum(ends[-1] + (pad + tokens_per_block - 1) // tokens_per_block, num_blocks)
    lead = jnp.argmax(jnp.append(q_len != 1, True))  # the first sequence of another length
    return *out, jnp.stack([live, lead]).astype(jnp.int32)


def _gather(*idx):
    """An all-array index (each broadcast to one shape): Pallas's interpreter cannot mix index
    arrays with slices, the Triton lowering takes either."""
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in idx))
    return tuple(jnp.broadcast_to(i, shape) for i in idx)


FP8_DOTS = ("q", "f16", "f16_swap", "f16_swap_qk", "fma", "fma_rows", "e4m3")


def rows_per_block(block_rows, group, fp8_dot="q", float8=False):
    """The query rows of a program: MMAs take 16 at least; the float8 "fma" path G at least."""
    least = 1 if float8 and fp8_dot.startswith("fma") else 16
    return max(block_rows, least, pl.next_power_of_2(group))


def _swapped_scores(q, k, scale, softcap):
    """`flash.scores` as (k q^T)^T: the tile k is the MMA's left operand."""
    return base2_logits(plgpu.dot(k, q, trans_b=True).T, scale, softcap)


def _swapped_pv(p, v):
    """P V as (V^T P^T)^T: the tile v is the MMA's left operand."""
    return plgpu.dot(v, p.astype(v.dtype), trans_a=True, trans_b=True).T


def _e4m3_terms(q):
    """q [R, D] as two e4m3 terms with per-row float32 scales: q ~ hi * s_hi + lo * s_lo."""
    def term(x):
        s = jnp.max(jnp.abs(x), axis=1, keepdims=True) * (1.0 / FP8_MAX)
        s = jnp.where(s == 0.0, 1.0, s)
        return (x / s).astype(jnp.float8_e4m3fn), s
    hi, s_hi = term(q)
    lo, s_lo = term(q - hi.astype(jnp.float32) * s_hi)
    return hi, s_hi, lo, s_lo


def _e4m3_scores(q, k, scale, softcap):
    """`flash.scores` with q as `_e4m3_terms` and k a float8 tile: two float8 MMAs."""
    hi, s_hi, lo, s_lo = q
    s = plgpu.dot(hi, k, trans_b=True) * s_hi + plgpu.dot(lo, k, trans_b=True) * s_lo
    return base2_logits(s, scale, softcap)


def _fma_scores(q, k, scale, softcap, by_row=False):
    """`flash.scores` on the CUDA cores: q [R, D], k [BK, D] float32."""
    if by_row:
        r = jnp.arange(q.shape[0])[:, None]
        s = jnp.zeros((q.shape[0], k.shape[0]), jnp.float32)
        for g in range(q.shape[0]):
            q_g = jnp.sum(jnp.where(r == g, q, 0.0), axis=0)
            s = jnp.where(r == g, jnp.sum(k * q_g[None, :], axis=1)[None, :], s)
    else:
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=2)
    if softcap is None:
        return s * (scale * LOG2E)
    return (softcap * LOG2E) * jnp.tanh(s * (scale / softcap))


def _fma_pv(p, v, by_row=False):
    """P V on the CUDA cores: p [R, BK], v [BK, D] float32."""
    if not by_row:
        return jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    r = jnp.arange(p.shape[0])[:, None]
    o = jnp.zeros((p.shape[0], v.shape[1]), jnp.float32)
    for g in range(p.shape[0]):
        p_g = jnp.sum(jnp.where(r == g, p, 0.0), axis=0)
        o = jnp.where(r == g, jnp.sum(p_g[:, None] * v, axis=0)[None, :], o)
    return o


def _kernel(*refs, decode, **kw):
    """One (block, kv head, split) item a program. In a ragged call the leading one-token
    sequences' blocks take the decode branch (the ragged one would first wait on their
    metadata; 0.88x the time for 200 decode rows on the H200), and a block past the last
    token below T returns (most blocks of a step of a few long chunks in a 256-row bucket)."""
    b, h, hoist = pl.program_id(0), pl.program_id(1), kw.pop("hoist_decode")
    item = functools.partial(_item, b=b, h=h, split=pl.program_id(2), **kw)
    if decode:  # block b is sequence b: none is padding
        return item(refs, decode=True)
    counts_ref, *refs = refs
    pre = None
    if hoist:  # the decode branch's first loads in flight beside the counts'
        pre = _decode_loads(refs[3:], b, h, kw["group"], kw["num_heads"], kw["block_rows"])
    live, lead = counts_ref[0], counts_ref[1]
    pl.when(b < lead)(lambda: item(refs[3:], decode=True, pre=pre))  # past seq, tok, qs
    pl.when((b >= lead) & (b < live))(lambda: item(refs, decode=False))


def _decode_loads(refs, b, h, group, num_heads, block_rows):
    """(context length, q rows) of block b as a decode block (its token's G rows, as `_item`
    reads them), loaded whatever the block is: b is clamped to the sequences, rows past the
    tokens are masked."""
    ctx_ref, _, q_ref = refs[:3]
    r = jnp.arange(block_rows)
    rows = (b + r // group) * num_heads + h * group + r % group
    live = (r < group) & (b < q_ref.shape[0] // num_heads)
    at = _gather(rows[:, None], jnp.arange(q_ref.shape[-1])[None, :])
    return (ctx_ref[jnp.minimum(b, ctx_ref.shape[0] - 1)],
            plgpu.load(q_ref.at[at], mask=live[:, None], other=0.0))


def _item(refs, b, h, split, *, sm_scale, group, num_heads, block_rows, pages_per_block,
          pages_per_seq, num_splits, split_tiles, prefetch_pages, decode, window, softcap,
          fp8_dot, pre=None):
    if decode:  # block b is sequence b's one token: no metadata to read
        ctx_ref, pt_ref, q_ref, k_ref, v_ref, sinks_ref, scale_ref, *out_refs = refs
        s = t0 = q_lo = b
        q_hi = s + 1
        ctx = ctx_ref[s] if pre is None else pre[0]
    else:
        (seq_ref, tok_ref, qs_ref, ctx_ref, pt_ref, q_ref, k_ref, v_ref, sinks_ref, scale_ref,
         *out_refs) = refs
        s, t0 = seq_ref[b], tok_ref[b]
        # A block of padding tokens (sequence S) is a sequence with no context whose tokens run
        # from t0 to the end: its rows get zeros.
        pad = s == ctx_ref.shape[0]
        s = jnp.where(pad, 0, s)
        q_lo = jnp.where(pad, t0, qs_ref[s])
        q_hi = jnp.where(pad, q_ref.shape[0] // num_heads, qs_ref[s + 1])
        ctx = jnp.where(pad, 0, ctx_ref[s])
    D = q_ref.shape[-1]
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    tpb = block_rows // group  # tokens per block

    r = jnp.arange(block_rows)
    tok = t0 + r // group
    row_ok = (tok < q_hi) & (r < tpb * group)
    # q and the outputs are [T * H, D]: a row's (token, head) is read and written in place.
    # Masked lanes never touch memory on the GPU; in the interpreter their rows are in bounds
    # and distinct from the live ones, or out of bounds (clamped on load, dropped on store).
    rows = tok * num_heads + h * group + r % group
    at_rows = _gather(rows[:, None], jnp.arange(D)[None, :])
    pos = ctx - (q_hi - q_lo) + (tok - q_lo)  # cache position of each row's token
    first_pos = ctx - (q_hi - q_lo) + (t0 - q_lo)
    n_tok = jnp.clip(q_hi - t0, 0, tpb)
    kv_len = jnp.where(n_tok > 0, jnp.minimum(first_pos + n_tok, pages_per_seq * page_size), 0)
    kv_len = jnp.maximum(kv_len, 0)

    q = (plgpu.load(q_ref.at[at_rows], mask=row_ok[:, None], other=0.0) if pre is None
         else pre[1])
    scale, v_scale = sm_scale, None
    if scale_ref is not None:  # float8 pages: per-kv-head scales
        scale, v_scale = sm_scale * scale_ref[h], scale_ref[pl.num_programs(1) + h]
    float8 = k_ref.dtype == jnp.float8_e4m3fn
    v_keys_last = keys_last(v_ref)
    tile_dtype, score, pv = q.dtype, scores, None
    if float8 and fp8_dot.startswith("f16"):
        tile_dtype, q = jnp.float16, q.astype(jnp.float16)
        if fp8_dot.startswith("f16_swap"):
            score = _swapped_scores
            pv = _swapped_pv if fp8_dot == "f16_swap" else None
    elif float8 and fp8_dot == "e4m3":
        tile_dtype, score = jnp.float16, _e4m3_scores
        q = _e4m3_terms(q.astype(jnp.float32))
    elif float8 and fp8_dot.startswith("fma"):
        by_row = fp8_dot == "fma_rows"
        tile_dtype, q = jnp.float32, q.astype(jnp.float32)
        score = functools.partial(_fma_scores, by_row=by_row)
        pv = functools.partial(_fma_pv, by_row=by_row)
    # Keys are counted from `base`, the first key of the page that holds the first visible key.
    first_page = 0
    if window is not None:
        first_page = jnp.clip((first_pos - window + 1) // page_size, 0, pages_per_seq)
        if split_tiles:  # tiles and splits on fixed key boundaries (the keys before: masked)
            first_page -= first_page % (split_tiles * pages_per_block)
    base = first_page * page_size

    def load_pages(j):
        p0 = first_page + j * pages_per_block
        pidx = p0 + jnp.arange(pages_per_block)
        return plgpu.load(pt_ref.at[pl.ds(s * pages_per_seq + p0, pages_per_block)],
                          mask=pidx * page_size < kv_len, other=0)

    def convert(x):
        if float8 and tile_dtype == jnp.float32:  # e4m3 -> f16 is one instruction, f16 -> f32 too
            x = x.astype(jnp.float16)
        return x.astype(tile_dtype)

    def tile(j, carry, masked):
        pages, *carry = carry
        if prefetch_pages:  # next tile's page ids now, so its K/V loads need no index wait
            pages, next_pages = pages, load_pages(j + 1)
        else:
            pages = next_pages = load_pages(j)
        cols = base + j * block_k + jnp.arange(block_k)
        k = k_ref[pages].reshape(block_k, D)
        if v_keys_last:  # [pages, D, page] -> [D, keys], converted, then a register transpose
            # Stale slots past the context hold anything (0 * NaN is NaN): a masked tile loads
            # zeros there, so no select stands between the load and the MMA operand's layout.
            at = v_ref.at[_gather(pages[None, :, None], jnp.arange(D)[:, None, None],
                                  jnp.arange(page_size)[None, None, :])]
            if masked:
                fresh = (cols < kv_len).reshape(1, pages_per_block, page_size)
                v = plgpu.load(at, mask=jnp.broadcast_to(fresh, (D, pages_per_block, page_size)),
                               other=0.0)
            else:
                v = plgpu.load(at)
            v = convert(v.reshape(D, block_k)).T
        else:
            v = convert(v_ref[pages].reshape(block_k, D))
            if masked:
                v = jnp.where((cols < kv_len)[:, None], v, jnp.zeros_like(v))
        k = k if score is _e4m3_scores else convert(k)
        sc = score(q, k, scale, softcap)
        mask = None
        if masked:
            mask = cols[None, :] <= pos[:, None]
            if window is not None:
                mask = mask & (cols[None, :] > pos[:, None] - window)
        return (next_pages, *online_softmax_step(sc, mask, v, carry, pv))

    # This split's share of the key tiles. Tiles [lo, edge) cross the window's edge and
    # [mid, hi) the diagonal: they need a mask; [edge, mid) do not.
    n_tiles = pl.cdiv(jnp.maximum(kv_len - base, 0), block_k)
    share = split_tiles or pl.cdiv(n_tiles, num_splits)
    lo = jnp.minimum(split * share, n_tiles)
    hi = jnp.minimum(lo + share, n_tiles)
    edge = lo
    if window is not None:
        last_pos = first_pos + n_tok - 1
        edge = jnp.clip(pl.cdiv(last_pos - window + 1 - base, block_k), lo, hi)
    mid = jnp.clip((first_pos + 1 - base) // block_k, edge, hi)
    carry = (load_pages(lo),
             jnp.zeros((block_rows, D), jnp.float32),
             jnp.full((block_rows,), NEG_INF, jnp.float32),
             jnp.zeros((block_rows,), jnp.float32))
    if window is not None:
        carry = lax.fori_loop(lo, edge, functools.partial(tile, masked=True), carry)
    carry = lax.fori_loop(edge, mid, functools.partial(tile, masked=False), carry)
    _, o, m, l = lax.fori_loop(mid, hi, functools.partial(tile, masked=True), carry)

    sink = None
    if sinks_ref is not None:  # the sink joins the softmax once: in split 0
        sink = plgpu.load(sinks_ref.at[h * group + r % group]) * LOG2E
        if num_splits > 1:
            sink = jnp.where(split == 0, sink, NEG_INF)
    o, m, l = finish(o, m, l, sink)
    if v_scale is not None:
        o = o * v_scale
    plgpu.store(out_refs[0].at[at_rows], o.astype(out_refs[0].dtype), mask=row_ok[:, None])
    if num_splits > 1:  # base-2 log-sum-exp of this split; empty splits weigh nothing
        lse = jnp.where(l == 0.0, NEG_INF, m + jnp.log2(jnp.where(l == 0.0, 1.0, l)))
        plgpu.store(out_refs[1].at[rows], lse, mask=row_ok)


def _combine(o, lse):
    """o [splits, ...rows, D] float32 normalized per split, lse [splits, ...rows] base 2: the
    reference for `merge_splits`."""
    m = jnp.max(lse, axis=0)
    w = jnp.exp2(lse - m[None])
    w = jnp.where(lse <= NEG_INF / 2, 0.0, w)
    den = jnp.sum(w, axis=0)
    return jnp.sum(w[..., None] * o, axis=0) / jnp.where(den == 0, 1.0, den)[..., None]


def _merge_kernel(live_ref, lse_ref, o_ref, out_ref, *, num_splits, block_rows, group,
                  stride):
    r0 = pl.program_id(0) * block_rows
    rows = r0 + jnp.arange(block_rows)
    ok = rows < out_ref.shape[0]
    src = rows // group * stride + rows % group  # the input row of each output row
    # Every split's rows in one load each (one round trip; loads in a loop went one by one).
    sp = jnp.arange(pl.next_power_of_2(num_splits))[:, None]
    present = (sp < num_splits) & ok[None, :]
    lse = plgpu.load(lse_ref.at[_gather(sp, src[None, :])], mask=present, other=NEG_INF)
    o = plgpu.load(o_ref.at[_gather(sp[:, :, None], src[None, :, None],
                                    jnp.arange(o_ref.shape[-1])[None, None, :])],
                   mask=present[:, :, None], other=0.0)
    m = jnp.max(lse, axis=0)
    w = jnp.where(lse <= NEG_INF / 2, 0.0, jnp.exp2(lse - m[None, :]))
    den = jnp.sum(w, axis=0)
    out = jnp.sum(w[:, :, None] * o, axis=0) / jnp.where(den == 0.0, 1.0, den)[:, None]
    out = jnp.where((rows < live_ref[0])[:, None], out, 0.0)  # rows of no token: zeros
    plgpu.store(out_ref.at[pl.ds(r0, block_rows), :], out.astype(out_ref.dtype),
                mask=ok[:, None])


def merge_splits(o, lse, live_rows, out_dtype, *, group=None, stride=None, block_rows=4,
                 interpret=False):
    """One launch that merges split-K partials o [splits, R, D] (float32, each normalized) by
    their base-2 log-sum-exps lse [splits, R] -> [R, D]; output rows from `live_rows` on are
    zeros. With `group` and `stride`, input rows come in groups of `stride` of which the first
    `group` are kept (padded head groups) -> [R // stride * group, D].
    (In jnp, `_combine` and the zeroing are three XLA kernels.)"""
    NS, R, D = o.shape
    group, stride = group or 1, stride or 1
    n_out = R // stride * group
    whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=NS, block_rows=block_rows, group=group,
                          stride=stride),
        grid=(pl.cdiv(n_out, block_rows),),
        in_specs=[whole(1), whole(NS, R), whole(NS, R, D)],
        out_specs=whole(n_out, D),
        out_shape=jax.ShapeDtypeStruct((n_out, D), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="pallasite_merge_splits",
    )(jnp.reshape(live_rows, (1,)).astype(jnp.int32), lse, o)


def attend(q, k_pages, v_pages, meta, context_lens, page_table, *, sm_scale=None,
           sliding_window=None, logit_softcap=None, sinks=None, k_scale=None, v_scale=None,
           block_rows=64, pages_per_block=4, num_splits=1, split_tiles=None, num_warps=4,
           num_stages=2, prefetch_pages=True, fp8_dot="q", hoist_decode=False,
           interpret=False):
    """The kernel launch alone, on q [T, H, D] and per-block metadata (seq, tok, query_start,
    counts: `block_metadata`'s), or None for decode (block b = sequence b's one token).
    Returns [T * H, D], or with splits per-split outputs [splits, T * H, D] and base-2
    log-sum-exps [splits, T * H] (float32).
    `split_tiles`: every split takes that many key tiles from a fixed boundary (the last ones
    empty), instead of an even share of its block's tiles."""
    T, H, D = q.shape
    KV, P, page_size, _ = k_pages.shape
    S, pages_per_seq = page_table.shape
    G = H // KV
    block_rows = rows_per_block(block_rows, G, fp8_dot, k_pages.dtype == jnp.float8_e4m3fn)
    num_blocks = S if meta is None else meta[0].shape[0]
    grid = (num_blocks, KV, num_splits)
    whole = lambda *shape: pl.BlockSpec(shape, lambda b, h, sp: (0,) * len(shape))
    per_head = pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, sp: (h, 0, 0, 0))
    per_head_v = pl.BlockSpec((None, *v_pages.shape[1:]), lambda b, h, sp: (h, 0, 0, 0))
    in_specs = [whole(S), whole(S * pages_per_seq), whole(T * H, D), per_head, per_head_v,
                None if sinks is None else whole(H), None if k_scale is None else whole(2 * KV)]
    args = [context_lens.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1),
            q.reshape(T * H, D), k_pages, v_pages,
            None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(H),
            None if k_scale is None else jnp.concatenate([head_scale(k_scale, KV),
                                                          head_scale(v_scale, KV)])]
    if meta is not None:
        seq, tok, query_start, counts = meta
        in_specs = [whole(2), whole(num_blocks), whole(num_blocks), whole(S + 1)] + in_specs
        args = [counts, seq, tok, query_start.astype(jnp.int32)] + args
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((T * H, D), q.dtype)]
        out_specs = [whole(T * H, D)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, T * H, D), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, T * H), jnp.float32)]
        out_specs = [pl.BlockSpec((None, T * H, D), lambda b, h, sp: (sp, 0, 0)),
                     pl.BlockSpec((None, T * H), lambda b, h, sp: (sp, 0))]
    kernel = functools.partial(
        _kernel, sm_scale=D ** -0.5 if sm_scale is None else sm_scale, group=G, num_heads=H,
        block_rows=block_rows, pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
        num_splits=num_splits, split_tiles=split_tiles, prefetch_pages=prefetch_pages,
        decode=meta is None, window=sliding_window, softcap=logit_softcap, fp8_dot=fp8_dot,
        hoist_decode=hoist_decode)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pallasite_ragged_paged_attention",
    )(*args)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "logit_softcap", "block_rows", "pages_per_block", "num_splits",
    "split_tiles", "num_warps", "num_stages", "num_blocks", "one_token_per_seq", "prefetch_pages",
    "fp8_dot", "hoist_decode", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens, page_table, *,
                           sm_scale=None, sliding_window=None, logit_softcap=None, sinks=None,
                           k_scale=None, v_scale=None, block_rows=64, pages_per_block=4, num_splits=1,
                           split_tiles=None, num_warps=4, num_stages=2, num_blocks=None,
                           one_token_per_seq=False, prefetch_pages=True, fp8_dot="q",
                           hoist_decode=False, interpret=False):
    """q [T, H, D] -> [T, H, D]; see reference.ragged_paged_attention_reference.

    A decode call (`one_token_per_seq`) is one launch, two with splits: the kernel reads q and
    writes the output in their own layout, and the split merge is one kernel too.
    `hoist_decode`: a ragged call's blocks load their decode inputs (context length, q) before
    they know whether they are decode blocks (float8 pages on the H200: a paced step's attention
    0.0969 against 0.1014 ms a layer; bf16 pages: 0.1240 against 0.1226, so not there)."""
    T, H, D = q.shape
    KV, P, page_size, _ = k_pages.shape
    S = page_table.shape[0]
    if H % KV:
        raise ValueError(f"{H=} query heads is not a multiple of {KV=} kv heads")
    for name, x in (("head_dim", D), ("page_size", page_size), ("block_rows", block_rows),
                    ("pages_per_block", pages_per_block)):
        if x & (x - 1):
            raise ValueError(f"{name} {x} must be a power of two")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window {sliding_window} must be >= 1")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("quantized pages need both k_scale and v_scale")
    if fp8_dot not in FP8_DOTS:
        raise ValueError(f"fp8_dot {fp8_dot!r} is not one of {FP8_DOTS}")
    if one_token_per_seq and T != S:
        raise ValueError(f"decode takes one token per sequence: {T=} tokens, {S=} sequences")
    G = H // KV
    tpb = rows_per_block(block_rows, G, fp8_dot, k_pages.dtype == jnp.float8_e4m3fn) // G
    meta = None
    if not one_token_per_seq:
        if num_blocks is None:  # enough for any split of T tokens into S sequences
            num_blocks = pl.cdiv(T, tpb) + S
        qs = query_start.astype(jnp.int32)
        seq, tok, counts = block_metadata(qs, tpb, num_blocks, T)
        meta = (seq, tok, qs, counts)
    outs = attend(q, k_pages, v_pages, meta, context_lens, page_table, sm_scale=sm_scale,
                  sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                  k_scale=k_scale, v_scale=v_scale, block_rows=block_rows, pages_per_block=pages_per_block,
                  num_splits=num_splits, split_tiles=split_tiles, num_warps=num_warps,
                  num_stages=num_stages, prefetch_pages=prefetch_pages, fp8_dot=fp8_dot,
                  hoist_decode=hoist_decode and not one_token_per_seq, interpret=interpret)
    if num_splits > 1:
        live = T * H if one_token_per_seq else query_start[-1] * H
        o = merge_splits(*outs, live, q.dtype, interpret=interpret)
    else:
        o = outs[0]
    return o.reshape(T, H, D)


def paged_attention(q, k_pages, v_pages, context_lens, page_table, *, sm_scale=None,
                    sliding_window=None, logit_softcap=None, sinks=None, k_scale=None,
                    v_scale=None, block_rows=16, pages_per_block=8, num_splits=1, num_warps=4, num_stages=2,
                    prefetch_pages=True, fp8_dot="q", hoist_decode=False, interpret=False):
    """Decode: q [S, H, D], one token per sequence -> [S, H, D] (`hoist_decode`: no effect,
    a decode call has no block metadata to wait for)."""
    S = q.shape[0]
    query_start = jnp.arange(S + 1, dtype=jnp.int32)
    return ragged_paged_attention(
        q, k_pages, v_pages, query_start, context_lens, page_table, sm_scale=sm_scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, block_rows=block_rows, pages_per_block=pages_per_block, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, one_token_per_seq=True,
        prefetch_pages=prefetch_pages, fp8_dot=fp8_dot, interpret=interpret)
