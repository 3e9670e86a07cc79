"""Plain `jnp` references for every attention kernel: written for clarity, used by the tests and
as the CPU path. Softmax in float32 whatever the input dtype; outputs in the query's dtype.

Layouts shared by all kernels:
  q (dense)      [B, T, H, D]         k, v (dense)  [B, S, KV, D]
  q (ragged)     [T, H, D]            one flat token axis, sequences back to back
  k_pages        [KV, num_pages, page_size, D]   (v_pages alike)
  page_table     [S, pages_per_seq]   int32 page ids, pages in any order
  context_lens   [S] int32            tokens in each sequence's cache *including* this step's
  query_start    [S + 1] int32        cumulative query offsets on the flat token axis
H must be a multiple of KV (GQA); query head h reads kv head h // (H // KV).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows give zeros rather than NaNs


def _softmax_attend(scores, v, dtype):
    """scores [..., H, T, S] (masked with NEG_INF), v [..., S, H, D] -> [..., T, H, D]."""
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)
    p = jnp.where(scores <= NEG_INF / 2, 0.0, p)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("...hts,...shd->...thd", p, v.astype(jnp.float32)).astype(dtype)


def attention_reference(q, k, v, *, causal=True, segment_ids=None, sm_scale=None):
    """Dense attention. q [B, T, H, D], k/v [B, S, KV, D]; segment_ids [B, T] (T == S) keeps
    packed documents apart. Causal masks align the last query with the last key."""
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    k = jnp.repeat(k, H // KV, axis=2)
    v = jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    mask = jnp.ones((T, S), bool)
    if causal:
        mask = jnp.arange(T)[:, None] + (S - T) >= jnp.arange(S)[None, :]
    mask = jnp.broadcast_to(mask, (B, T, S))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.where(mask[:, None], scores, NEG_INF)
    return _softmax_attend(scores, v, q.dtype)


def gather_pages(pages, page_table):
    """[KV, P, page_size, D] x [S, pages_per_seq] -> [S, pages_per_seq * page_size, KV, D]."""
    kv, _, page_size, d = pages.shape
    g = pages[:, page_table]  # [KV, S, n, page_size, D]
    g = g.reshape(kv, page_table.shape[0], -1, d)
    return jnp.transpose(g, (1, 2, 0, 3))


def paged_attention_reference(q, k_pages, v_pages, context_lens, page_table, *, sm_scale=None):
    """Decode: one query token per sequence. q [S, H, D] -> [S, H, D]. A sequence with
    context_lens == 0 gets zeros."""
    S, H, D = q.shape
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    mask = jnp.arange(k.shape[1])[None, None, :] < context_lens[:, None, None]  # [S, 1, L]
    return attention_reference_masked(q[:, None], k, v, mask, sm_scale)[:, 0]


def attention_reference_masked(q, k, v, mask, sm_scale=None):
    """q [B, T, H, D], k/v [B, S, KV, D], mask [B, T, S] -> [B, T, H, D]."""
    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    k = jnp.repeat(k, H // KV, axis=2)
    v = jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    scores = jnp.where(mask[:, None], scores, NEG_INF)
    return _softmax_attend(scores, v, q.dtype)


def token_sequence_ids(query_start, num_tokens):
    """For each slot of the flat token axis, the sequence it belongs to (padding slots past the
    last sequence get an index whose query range is empty)."""
    return jnp.searchsorted(query_start, jnp.arange(num_tokens), side="right") - 1


def ragged_paged_attention_reference(q, k_pages, v_pages, query_start, context_lens, page_table,
                                     *, sm_scale=None):
    """Mixed prefill chunks and decode tokens. q [T, H, D]: sequence s owns tokens
    query_start[s]:query_start[s+1], the last q_len tokens of its context_lens[s]-long context,
    whose K/V are already in the pages. Token i of the chunk sits at position
    context_len - q_len + i and sees keys 0..that position. Padding tokens get zeros."""
    T = q.shape[0]
    S = page_table.shape[0]
    seq = jnp.clip(token_sequence_ids(query_start, T), 0, S - 1)
    q_len = query_start[1:] - query_start[:-1]
    in_seq = (jnp.arange(T) >= query_start[seq]) & (jnp.arange(T) < query_start[seq + 1])
    pos = context_lens[seq] - q_len[seq] + (jnp.arange(T) - query_start[seq])
    k = gather_pages(k_pages, page_table)[seq]  # [T, L, KV, D]
    v = gather_pages(v_pages, page_table)[seq]
    key_pos = jnp.arange(k.shape[1])
    mask = (key_pos[None, :] <= pos[:, None]) & in_seq[:, None]  # [T, L]
    return attention_reference_masked(q[:, None], k, v, mask[:, None], sm_scale)[:, 0]


def write_kv_reference(k_pages, v_pages, k, v, slots):
    """Scatter new K/V [T, KV, D] into the pages at flat slots (page * page_size + offset).
    Slots < 0 are dropped (padding tokens)."""
    page_size = k_pages.shape[2]
    num_pages = k_pages.shape[1]
    # Out-of-range page ids are dropped by the scatter, so padding never lands on a real page.
    page = jnp.where(slots >= 0, slots // page_size, num_pages)
    offset = jnp.where(slots >= 0, slots % page_size, 0)
    k_pages = k_pages.at[:, page, offset].set(jnp.swapaxes(k, 0, 1).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, page, offset].set(jnp.swapaxes(v, 0, 1).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def grouped_mlp_reference(x, group_sizes, w_gate, w_up, w_down):
    """SwiGLU experts over rows sorted by expert (group g's rows use expert g's weights); rows
    past sum(group_sizes) give zeros."""
    h = jax.nn.silu(jax.lax.ragged_dot(x, w_gate, group_sizes))
    h = h * jax.lax.ragged_dot(x, w_up, group_sizes)
    return jax.lax.ragged_dot(h, w_down, group_sizes)
