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

Options every attention entry takes (None = off):
  sm_scale        score scale (default D ** -0.5; Gemma passes query_pre_attn_scalar ** -0.5)
  sliding_window  W: a query at position p sees the keys at positions p - W < j <= p (W keys,
                  itself included), the window of transformers' sliding attention
  logit_softcap   c: scores (after sm_scale) become c * tanh(scores / c) before masking
  sinks           [H] float logits (natural-log units, unscaled) that join each row's softmax
                  denominator and attend to nothing (GPT-OSS)
  k_scale/v_scale per-KV-head float32 scales, [KV] or [KV, 1, 1, 1] (paged entries): the
                  pages hold K / k_scale (float8_e4m3fn), read back as pages * k_scale
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows give zeros rather than NaNs


def _softmax_attend(scores, v, dtype, sinks=None):
    """scores [..., H, T, S] (masked with NEG_INF), v [..., S, H, D] -> [..., T, H, D].
    sinks [H]: one more logit per head in every row's denominator, with no value."""
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[:, None, None]
        m = jnp.maximum(m, sink)
    p = jnp.exp(scores - m)
    p = jnp.where(scores <= NEG_INF / 2, 0.0, p)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("...hts,...shd->...thd", p, v.astype(jnp.float32)).astype(dtype)


def window_mask(q_pos, k_pos, sliding_window):
    """True where key position k_pos is inside the window of query position q_pos."""
    if sliding_window is None:
        return True
    return k_pos > q_pos - sliding_window


def attention_reference(q, k, v, *, causal=True, segment_ids=None, sm_scale=None,
                        sliding_window=None, logit_softcap=None, sinks=None):
    """Dense attention. q [B, T, H, D], k/v [B, S, KV, D]; segment_ids [B, T] (T == S) keeps
    packed documents apart. Causal masks align the last query with the last key (query t sits
    at position t + S - T, which the sliding window counts from)."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    q_pos, k_pos = jnp.arange(T)[:, None] + (S - T), jnp.arange(S)[None, :]
    mask = jnp.ones((T, S), bool)
    if causal:
        mask = q_pos >= k_pos
    mask = mask & window_mask(q_pos, k_pos, sliding_window)
    mask = jnp.broadcast_to(mask, (B, T, S))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return attention_reference_masked(q, k, v, mask, sm_scale, logit_softcap=logit_softcap,
                                      sinks=sinks)


def head_scale(scale, num_kv_heads):
    """A per-KV-head scale given as a scalar, [KV] or [KV, 1, 1, 1] (the cache's form, which
    shards like the pages) -> float32 [KV]."""
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (num_kv_heads,))


def keys_last(v_pages) -> bool:
    """Whether V pages hold each page as [D, page_size], keys on the fast axis: float8 pages do
    ([KV, P, D, page_size]), so that the paged kernel's P V takes its converted float8 tile as
    an MMA operand straight from registers, where a [page_size, D] tile goes back through
    shared memory first (docs/kernels_notes.md, "Float8 V pages keys-last"). K pages, and V
    pages of 16 bits, are [KV, P, page_size, D]."""
    return jnp.dtype(v_pages.dtype).itemsize == 1


def rows_first(v_pages):
    """V pages (or a gather of them, pages on the third axis from the end) as
    [..., page_size, D]."""
    return jnp.swapaxes(v_pages, -1, -2) if keys_last(v_pages) else v_pages


def gather_pages(pages, page_table, scale=None, v=False):
    """[KV, P, page_size, D] x [S, pages_per_seq] -> [S, pages_per_seq * page_size, KV, D];
    with scale [KV], float32 pages * scale (dequantized). `v`: V pages, keys-last if float8."""
    g = pages[:, page_table]  # [KV, S, n, page_size, D]
    if v:
        g = rows_first(g)
    kv, d = g.shape[0], g.shape[-1]
    g = g.reshape(kv, page_table.shape[0], -1, d)
    g = jnp.transpose(g, (1, 2, 0, 3))
    if scale is not None:
        g = g.astype(jnp.float32) * head_scale(scale, kv)[:, None]
    return g


def paged_attention_reference(q, k_pages, v_pages, context_lens, page_table, *, sm_scale=None,
                              sliding_window=None, logit_softcap=None, sinks=None,
                              k_scale=None, v_scale=None):
    """Decode: one query token per sequence, at position context_lens - 1. q [S, H, D] ->
    [S, H, D]. A sequence with context_lens == 0 gets zeros."""
    k = gather_pages(k_pages, page_table, k_scale)
    v = gather_pages(v_pages, page_table, v_scale, v=True)
    k_pos = jnp.arange(k.shape[1])[None, None, :]
    q_pos = context_lens[:, None, None] - 1
    mask = (k_pos <= q_pos) & window_mask(q_pos, k_pos, sliding_window)  # [S, 1, L]
    return attention_reference_masked(q[:, None], k, v, mask, sm_scale,
                                      logit_softcap=logit_softcap, sinks=sinks)[:, 0]


def attention_reference_masked(q, k, v, mask, sm_scale=None, *, logit_softcap=None,
                               sinks=None):
    """q [B, T, H, D], k/v [B, S, KV, D], mask [B, T, S] -> [B, T, H, D]."""
    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    k = jnp.repeat(k, H // KV, axis=2)
    v = jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    if logit_softcap is not None:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    scores = jnp.where(mask[:, None], scores, NEG_INF)
    return _softmax_attend(scores, v, q.dtype, sinks)


def token_sequence_ids(query_start, num_tokens):
    """For each slot of the flat token axis, the sequence it belongs to (padding slots past the
    last sequence get an index whose query range is empty)."""
    return jnp.searchsorted(query_start, jnp.arange(num_tokens), side="right") - 1


def ragged_paged_attention_reference(q, k_pages, v_pages, query_start, context_lens, page_table,
                                     *, sm_scale=None, sliding_window=None, logit_softcap=None,
                                     sinks=None, k_scale=None, v_scale=None):
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
    k = gather_pages(k_pages, page_table, k_scale)[seq]  # [T, L, KV, D]
    v = gather_pages(v_pages, page_table, v_scale, v=True)[seq]
    key_pos = jnp.arange(k.shape[1])[None, :]
    mask = (key_pos <= pos[:, None]) & in_seq[:, None]  # [T, L]
    mask = mask & window_mask(pos[:, None], key_pos, sliding_window)
    return attention_reference_masked(q[:, None], k, v, mask[:, None], sm_scale,
                                      logit_softcap=logit_softcap, sinks=sinks)[:, 0]


def quantize_kv(x, scale, dtype):
    """x [T, KV, D] -> x / scale [KV] in `dtype`, saturated to its finite range (float8
    e4m3fn has no infinity: an overflow would be NaN)."""
    x = x.astype(jnp.float32) / head_scale(scale, x.shape[1])[None, :, None]
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -big, big).astype(dtype)


def write_kv_reference(k_pages, v_pages, k, v, slots, *, k_scale=None, v_scale=None):
    """Scatter new K/V [T, KV, D] into the pages at flat slots (page * page_size + offset).
    Slots < 0 are dropped (padding tokens). With k_scale/v_scale [KV] the rows are stored
    quantized (`quantize_kv`)."""
    if k_scale is not None:
        k = quantize_kv(k, k_scale, k_pages.dtype)
        v = quantize_kv(v, v_scale, v_pages.dtype)
    page_size = k_pages.shape[2]
    num_pages = k_pages.shape[1]
    # Out-of-range page ids are dropped by the scatter, so padding never lands on a real page.
    page = jnp.where(slots >= 0, slots // page_size, num_pages)
    offset = jnp.where(slots >= 0, slots % page_size, 0)
    k_pages = k_pages.at[:, page, offset].set(jnp.swapaxes(k, 0, 1).astype(k_pages.dtype), mode="drop")
    if keys_last(v_pages):  # [KV, P, D, page]: the indexed axes lead the update, [T, KV, D]
        return k_pages, v_pages.at[:, page, :, offset].set(v.astype(v_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, page, offset].set(jnp.swapaxes(v, 0, 1).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def rms_norm(x, weight, *, eps, plus_one=False):
    """RMSNorm over x's last axis in float32, scaled by `weight` and in x's dtype: weight times
    the normalized x rounded first, or (`plus_one`, Gemma) by 1 + weight in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)


def rotate_halves(x, cos, sin):
    """x [..., T, heads, D] turned by the RoPE tables cos/sin [..., T, R / 2]: the two halves of
    its leading R columns (HF convention), the rest passed over; in float32, then x's dtype."""
    rot = 2 * cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = jnp.split(x[..., :rot].astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if rot == x.shape[-1] else jnp.concatenate([out, x[..., rot:]], axis=-1)


def rope_projection(y, cos, sin, bias=None, norm=None, *, eps=1e-6, plus_one=False):
    """A fused projection y [T, KV, G + 2, D] (per kv head its G queries, key and value), plus
    `bias` (bq [KV * G, D], bk [KV, D], bv [KV, D]) in y's dtype, each query and key head
    through `rms_norm` with `norm`'s (q's, k's) weights [D] -> q [T, KV * G, D] and k [T, KV, D]
    turned by the RoPE tables cos/sin [T, R / 2] (`rotate_halves`), and v [T, KV, D]."""
    T, KV, G2, D = y.shape
    if bias is not None:
        bq, bk, bv = (b.astype(y.dtype) for b in bias)
        y = y + jnp.concatenate([bq.reshape(KV, G2 - 2, D), bk[:, None], bv[:, None]], axis=1)
    q, k = y[:, :, :G2 - 2].reshape(T, KV * (G2 - 2), D), y[:, :, G2 - 2]
    if norm is not None:
        q, k = (rms_norm(x, w, eps=eps, plus_one=plus_one) for x, w in zip((q, k), norm))
    return rotate_halves(q, cos, sin), rotate_halves(k, cos, sin), y[:, :, G2 - 1]


def rope_write_kv_reference(y, k_pages, v_pages, slots, cos, sin, *, bias=None, norm=None,
                            eps=1e-6, plus_one=False, k_scale=None, v_scale=None):
    """A fused projection's epilogue (`rope_kv.py`): `rope_projection`'s q, and the pages with
    its keys and values written at slots (zeros past the head dim where pages are wider)."""
    q, k, v = rope_projection(y, cos, sin, bias, norm, eps=eps, plus_one=plus_one)
    k, v = (pad_last(x, k_pages.shape[-1]) for x in (k, v))
    return q, *write_kv_reference(k_pages, v_pages, k, v, slots, k_scale=k_scale,
                                  v_scale=v_scale)


def pad_last(x, width: int):
    """x with zeros after its last dim up to `width` (pages wider than the head dim)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def silu_glu(gate, up):
    return jax.nn.silu(gate) * up


def grouped_mlp_reference(x, group_sizes, w_gate, w_up, w_down, *, glu=silu_glu, biases=None):
    """Gated experts over rows sorted by expert (group g's rows use expert g's weights): SwiGLU,
    or `glu(gate, up)`, with optional per-expert `biases` (b_gate [E, F], b_up [E, F], b_down
    [E, D]). Rows past sum(group_sizes) give zeros."""
    gate, up = jax.lax.ragged_dot(x, w_gate, group_sizes), jax.lax.ragged_dot(x, w_up, group_sizes)
    if biases is not None:
        expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                            total_repeat_length=x.shape[0])
        gate, up = gate + biases[0][expert], up + biases[1][expert]
    y = jax.lax.ragged_dot(glu(gate, up), w_down, group_sizes)
    if biases is None:
        return y
    real = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(real[:, None], y + biases[2][expert], 0)
