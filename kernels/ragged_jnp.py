"""Ragged paged attention in plain `jnp`, a block of keys at a time: the serving path where no
Pallas kernel runs (CPU).

The reference (`reference.ragged_paged_attention_reference`) gathers every token's whole page
table: T x pages_per_seq x page_size keys per layer. On a 30-layer model with 8k-token page tables
and a 512-token step that is gigabytes a layer, and it does the work for the table's width, not
for the context in use. Here the keys come a block at a time with an online softmax, and the
loop stops at the longest context in the batch, so memory is T x block and time follows the
context actually there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import NEG_INF, head_scale, rows_first, token_sequence_ids


def ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens, page_table, *,
                           sm_scale=None, sliding_window=None, logit_softcap=None, sinks=None,
                           k_scale=None, v_scale=None, pages_per_block: int = 8):
    """As `reference.ragged_paged_attention_reference`, options included: q [T, H, D] ->
    [T, H, D]. With a sliding window the loop starts at the first block any token sees."""
    T, H, D = q.shape
    KV, _, page_size, _ = k_pages.shape
    S, P = page_table.shape
    group, block = H // KV, pages_per_block * page_size
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    seq = jnp.clip(token_sequence_ids(query_start, T), 0, S - 1)
    q_len = query_start[1:] - query_start[:-1]
    t = jnp.arange(T)
    in_seq = (t >= query_start[seq]) & (t < query_start[seq + 1])
    pos = jnp.where(in_seq, context_lens[seq] - q_len[seq] + (t - query_start[seq]), -1)
    pad = -P % pages_per_block  # whole blocks: padding pages point at page 0, masked below
    table = jnp.pad(page_table, ((0, 0), (0, pad)))[seq]  # [T, P']
    qg = q.astype(jnp.float32).reshape(T, KV, group, D) * sm_scale
    ks, vs = (jnp.ones((KV,)) if x is None else head_scale(x, KV) for x in (k_scale, v_scale))
    if k_scale is not None:  # per-kv-head scales of quantized pages: K's joins q's
        qg = qg * ks[None, :, None, None]

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, i * pages_per_block, pages_per_block, 1)
        k = k_pages[:, pages].reshape(KV, T, block, D).astype(jnp.float32)
        v = rows_first(v_pages[:, pages]).reshape(KV, T, block, D).astype(jnp.float32)
        s = jnp.einsum("tkgd,ktbd->tkgb", qg, k)
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        cols = (i * block + jnp.arange(block))[None, :]
        visible = cols <= pos[:, None]  # [T, block]
        if sliding_window is not None:
            visible &= cols > pos[:, None] - sliding_window
        s = jnp.where(visible[:, None, None], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[..., None] + jnp.einsum("tkgb,ktbd->tkgd", p, v)
        return m_new, l * alpha + p.sum(-1), acc

    steps = -(-jnp.max(jnp.where(in_seq, pos + 1, 0)) // block)  # blocks the longest one needs
    init = (jnp.full((T, KV, group), NEG_INF, jnp.float32), jnp.zeros((T, KV, group), jnp.float32),
            jnp.zeros((T, KV, group, D), jnp.float32))
    first = 0
    if sliding_window is not None:  # blocks before every token's window are skipped
        first = jnp.maximum(jnp.min(jnp.where(in_seq, pos - sliding_window + 1, 2**30)), 0)
        first = jnp.minimum(first // block, steps)
    m, l, acc = jax.lax.fori_loop(first, steps, body, init)
    if sinks is not None:  # one more logit per head in each row's denominator
        sink = jnp.asarray(sinks, jnp.float32).reshape(1, KV, group)
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        acc, l = acc * alpha[..., None], l * alpha + jnp.exp(sink - m_new)
    out = acc * vs[None, :, None, None] / jnp.where(l == 0, 1.0, l)[..., None]
    return out.reshape(T, H, D).astype(q.dtype)
