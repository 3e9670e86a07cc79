"""Sliding windows, logit soft-capping, attention sinks and FP8 KV pages: the jnp references
against NumPy written from transformers' eager attention (Mistral/Gemma 2/GPT-OSS), then the
Pallas kernels in interpret mode against the references, with pages outside the window
poisoned with NaN to show the kernels never read them."""

from __future__ import annotations

import math

import jax
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


def poison(x, keys):
    """x [..., S, KV, D] with keys [..., :keys] set to NaN."""
    return jnp.asarray(x).at[..., :keys, :, :].set(jnp.nan)


@pytest.mark.parametrize("B,T,S,H,KV,window,softcap,sinks,bq,bk", [
    (1, 37, 37, 4, 1, 8, None, False, 16, 16),     # prefill, window crossing tile edges
    (2, 21, 70, 4, 2, 5, 25.0, True, 16, 16),      # chunk after a cache: early keys unread
    (1, 40, 40, 4, 4, None, 10.0, True, 16, 16),   # soft-cap and sinks, full causal
])
def test_flash_options(B, T, S, H, KV, window, softcap, sinks, bq, bk):
    rng = np.random.default_rng(T + S)
    D = 16
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, KV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, KV, D)), jnp.float32)
    opts = dict(sliding_window=window, logit_softcap=softcap,
                sinks=jnp.asarray(rng.standard_normal(H), jnp.float32) if sinks else None)
    ref = reference.attention_reference(q, k, v, **opts)
    if window is not None:  # whole key tiles no query can see: NaN, never read
        unseen = max(0, (S - T - window + 1) // bk * bk)
        k, v = poison(k, unseen), poison(v, unseen)
    out = flash.flash_attention(q, k, v, block_q=bq, block_k=bk, interpret=True, **opts)
    assert rel_err(out, ref) < 1e-5


def windowed_case(seed, q_lens, cached, H, KV, D, page_size, window, pad_tokens=0):
    """A ragged batch whose pages wholly outside every token's window hold NaN (those the
    kernel must not read), with the clean pages for the reference."""
    rng = np.random.default_rng(seed)
    ctx = np.asarray(q_lens) + np.asarray(cached)
    pps = -(-int(ctx.max()) // page_size) + 1
    S, P = len(ctx), len(ctx) * pps + 2
    table = rng.permutation(P)[: S * pps].reshape(S, pps).astype(np.int32)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qs[-1]) + pad_tokens, H, D)).astype(np.float32)
    kp, vp = (rng.standard_normal((KV, P, page_size, D)).astype(np.float32) for _ in range(2))
    bad_k, bad_v, unread = kp.copy(), vp.copy(), 0
    for s in range(S):
        first_visible = ctx[s] - q_lens[s] - (window or ctx[s]) + 1  # first token's first key
        if first_visible > 0:
            dead = table[s, : first_visible // page_size]
            bad_k[:, dead], bad_v[:, dead] = np.nan, np.nan
            unread += len(dead)
    to = lambda *xs: [jnp.asarray(x) for x in xs]
    return (*to(q, kp, vp, qs, ctx.astype(np.int32), table, bad_k, bad_v), unread)


WINDOW_CASES = [  # q_lens, cached, H, KV, page, window, softcap, sinks, splits, rows, ppb, pad
    ([1, 1, 1, 1], [90, 3, 47, 0], 8, 2, 8, 20, None, False, 1, 16, 2, 0),   # decode
    ([1, 1], [150, 64], 4, 1, 8, 33, 15.0, True, 3, 16, 2, 0),              # decode, splits
    ([13, 1, 7, 1], [60, 80, 0, 9], 8, 2, 8, 16, None, True, 1, 16, 2, 3),  # mixed
    ([20, 1], [70, 41], 4, 4, 16, 24, 30.0, True, 2, 32, 1, 0),             # mixed, splits
    ([9, 1, 1], [10, 33, 0], 8, 1, 8, None, 20.0, True, 2, 16, 2, 0),       # no window
]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_paged_options_skip_pages_outside_window(case):
    q_lens, cached, H, KV, page, window, softcap, sinks, splits, rows, ppb, pad = case
    q, kp, vp, qs, ctx, table, bad_k, bad_v, unread = windowed_case(
        len(q_lens) + sum(cached), q_lens, cached, H, KV, 16, page, window, pad)
    assert window is None or unread > 0
    opts = dict(sliding_window=window, logit_softcap=softcap,
                sinks=jnp.linspace(-2.0, 3.0, H) if sinks else None)
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table, **opts)
    kw = dict(num_splits=splits, block_rows=rows, pages_per_block=ppb, interpret=True, **opts)
    out = paged.ragged_paged_attention(q, bad_k, bad_v, qs, ctx, table, **kw)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out[int(qs[-1]):]) == 0)
    if max(q_lens) == 1 and not pad:  # the decode entry, on the same batch
        out = paged.paged_attention(q, bad_k, bad_v, ctx, table, **kw)
        assert rel_err(out, ref) < 1e-5


def quantized(pages, scale, v=False):
    """float8 pages of `pages` [KV, P, page, D] divided by scale [KV]; `v`: V pages, stored
    keys-last ([KV, P, D, page])."""
    out = (pages / scale[:, None, None, None]).astype(jnp.float8_e4m3fn)
    return jnp.swapaxes(out, 2, 3) if v else out


@pytest.mark.parametrize("decode,splits,window", [(True, 1, None), (True, 2, 12),
                                                  (False, 2, None)])
def test_paged_fp8_pages_dequantize_on_load(decode, splits, window):
    """float8 pages with per-kv-head scales against the reference on the same pages (the same
    math), and within float8 rounding of the unquantized attention."""
    q_lens, cached = ([1, 1, 1], [40, 7, 0]) if decode else ([11, 1], [30, 20])
    q, kp, vp, qs, ctx, table, *_ = windowed_case(5, q_lens, cached, 8, 2, 16, 8, None)
    k_scale, v_scale = jnp.asarray([0.5, 0.02]), jnp.asarray([0.01, 0.2])
    kp, vp = kp * jnp.asarray([5.0, 0.2])[:, None, None, None], vp * jnp.asarray([0.1, 2.0])[
        :, None, None, None]
    k8, v8 = quantized(kp, k_scale), quantized(vp, v_scale, v=True)
    q = q.astype(jnp.bfloat16)
    opts = dict(sliding_window=window, k_scale=k_scale, v_scale=v_scale)
    ref = reference.ragged_paged_attention_reference(q, k8, v8, qs, ctx, table, **opts)
    kw = dict(num_splits=splits, pages_per_block=2, interpret=True, **opts)
    if decode:
        out = paged.paged_attention(q, k8, v8, ctx, table, **kw)
    else:
        out = paged.ragged_paged_attention(q, k8, v8, qs, ctx, table, block_rows=16, **kw)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, ref) < 1e-2  # bf16 rounding of q K^T and P V
    full = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table,
                                                      sliding_window=window)
    assert rel_err(out, full) < 0.08  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hoist", [False, True])
def test_decode_rows_and_stale_slots(fp8, hoist):
    """Leading one-token sequences (the decode branch), a chunk and padding tokens, over pages
    that hold NaN in every slot past each sequence's context: with the decode inputs loaded
    before or after the block's kind is known (`hoist_decode`), the ragged call and the decode
    entry match the reference on the clean pages (bf16 pages, and float8 with V keys-last,
    whose last tile loads zeros past the context)."""
    q_lens, cached, page = [1, 1, 1, 6], [37, 20, 0, 9], 8
    q, kp, vp, qs, ctx, table, *_ = windowed_case(7, q_lens, cached, 8, 2, 16, page, None,
                                                  pad_tokens=3)
    bad_k, bad_v = np.asarray(kp).copy(), np.asarray(vp).copy()
    for s, n in enumerate(np.asarray(ctx)):
        for i, p in enumerate(np.asarray(table)[s]):  # the slots at positions >= n
            bad_k[:, p, max(n - i * page, 0):], bad_v[:, p, max(n - i * page, 0):] = np.nan, np.nan
    opts = {}
    if fp8:
        scale = jnp.asarray([0.02, 0.5])
        kp, vp = quantized(kp, scale), quantized(vp, scale, v=True)
        bad_k, bad_v = quantized(jnp.asarray(bad_k), scale), quantized(jnp.asarray(bad_v), scale,
                                                                       v=True)
        opts = dict(k_scale=scale, v_scale=scale, fp8_dot="f16")
    q = q.astype(jnp.bfloat16)
    kw = dict(block_rows=16, pages_per_block=2, num_splits=2, interpret=True, **opts)
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table,
                                                     **{k: v for k, v in opts.items()
                                                        if k != "fp8_dot"})
    out = paged.ragged_paged_attention(q, jnp.asarray(bad_k), jnp.asarray(bad_v), qs, ctx, table,
                                       hoist_decode=hoist, **kw)
    assert rel_err(out, ref) < 1e-2  # bf16 rounding of q, K, V and P
    assert np.all(np.asarray(out[int(qs[-1]):], np.float32) == 0)
    out = paged.paged_attention(q[:3], jnp.asarray(bad_k), jnp.asarray(bad_v), ctx[:3],
                                table[:3], **kw)
    assert rel_err(out, ref[:3]) < 1e-2


@pytest.mark.parametrize("fp8_dot,decode", [("f16", True), ("f16", False), ("f16_swap", True),
                                            ("f16_swap_qk", False), ("fma", True),
                                            ("fma_rows", True), ("fma_rows", False),
                                            ("e4m3", True), ("e4m3", False)])
def test_paged_fp8_dot_paths(fp8_dot, decode):
    """The float8 paths other than q's dtype ("f16" MMAs plain or transposed, "fma"/"fma_rows"
    CUDA-core products
    over only the group's rows) against the reference on the same pages, with splits, a window and
    soft-capping; the ragged entry with one-token blocks of G rows too."""
    q_lens, cached = ([1, 1, 1], [40, 7, 0]) if decode else ([3, 1], [30, 20])
    q, kp, vp, qs, ctx, table, *_ = windowed_case(5, q_lens, cached, 8, 2, 16, 8, None)
    k_scale, v_scale = jnp.asarray([0.5, 0.02]), jnp.asarray([0.01, 0.2])
    k8 = quantized(kp * jnp.asarray([5.0, 0.2])[:, None, None, None], k_scale)
    v8 = quantized(vp * jnp.asarray([0.1, 2.0])[:, None, None, None], v_scale, v=True)
    q = q.astype(jnp.bfloat16)
    opts = dict(sliding_window=30, logit_softcap=20.0, k_scale=k_scale, v_scale=v_scale)
    ref = reference.ragged_paged_attention_reference(q, k8, v8, qs, ctx, table, **opts)
    kw = dict(num_splits=2, pages_per_block=2, block_rows=1, fp8_dot=fp8_dot, interpret=True,
              **opts)
    if decode:
        out = paged.paged_attention(q, k8, v8, ctx, table, **kw)
    else:
        out = paged.ragged_paged_attention(q, k8, v8, qs, ctx, table, **kw)
    assert out.dtype == jnp.bfloat16
    # "fma" is float32 math like the reference; f16 rounds q, K, V and P once each.
    assert rel_err(out, ref) < (1e-5 if fp8_dot.startswith("fma") else 2e-3)
    with pytest.raises(ValueError, match="fp8_dot"):
        paged.paged_attention(q, k8, v8, ctx, table, **dict(kw, fp8_dot="bf16"))


def test_fp8_decode_takes_its_own_tiles(monkeypatch):
    """Decode over float8 pages takes the "decode_fp8" tiles; bf16 pages keep "decode"."""
    from pallasite.kernels import tuning
    seen = []
    monkeypatch.setattr(paged, "paged_attention", lambda *a, **kw: seen.append(kw))
    monkeypatch.setattr(paged, "ragged_paged_attention", lambda *a, **kw: seen.append(kw))
    table, lens = jnp.zeros((2, 4), jnp.int32), jnp.full((2,), 40, jnp.int32)
    scales = dict(k_scale=jnp.ones(2), v_scale=jnp.ones(2))
    for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
        q, pages = jnp.zeros((2, 8, 16), jnp.bfloat16), jnp.zeros((2, 8, 16, 16), dtype)
        opts = scales if dtype == jnp.float8_e4m3fn else {}
        kernels.paged_attention(q, pages, pages, lens, table, interpret=True, **opts)
        kernels.ragged_paged_attention(q, pages, pages, jnp.arange(3), lens, table, interpret=True,
                                       **opts)
    want = tuning.params("decode_fp8", 16)["fp8_dot"]
    assert [kw.get("fp8_dot") for kw in seen] == [want, want, None, None]
    # A mixed step (more tokens than twice the sequences) over float8 pages takes "ragged_fp8"
    # where the GPU's table has it (the H100's and the H200's), else the 16-bit "ragged" tiles.
    q, pages = jnp.zeros((6, 8, 16), jnp.bfloat16), jnp.zeros((2, 8, 16, 16), jnp.float8_e4m3fn)
    for gpu, dot in (("H200", "f16"), ("default", None)):
        monkeypatch.setattr(tuning, "gpu_key", lambda gpu=gpu: gpu)
        seen.clear()
        kernels.ragged_paged_attention(q, pages, pages, jnp.asarray([0, 6]), lens[:1],
                                       table[:1], interpret=True, **scales)
        assert seen[0].get("fp8_dot") == dot and seen[0]["block_rows"] == 64


def test_fp8_decode_long_tables_take_their_tiles(monkeypatch):
    """On the H200, float8 decode over page tables of 8192 keys or more takes the entry's
    `long` tiles (128 keys, two stages), the ragged entry's decode steps too; shorter tables
    keep 64 keys in three stages."""
    from pallasite.kernels import tuning
    monkeypatch.setattr(tuning, "gpu_key", lambda: "H200")
    seen = []
    monkeypatch.setattr(paged, "paged_attention", lambda *a, **kw: seen.append(kw))
    monkeypatch.setattr(paged, "ragged_paged_attention", lambda *a, **kw: seen.append(kw))
    scales = dict(k_scale=jnp.ones(2), v_scale=jnp.ones(2))
    q, k8 = jnp.zeros((2, 8, 16), jnp.bfloat16), jnp.zeros((2, 8, 16, 16), jnp.float8_e4m3fn)
    v8, lens = jnp.zeros((2, 8, 16, 16), jnp.float8_e4m3fn), jnp.full((2,), 40, jnp.int32)
    for pages in (256, 512):  # 4096 and 8192 keys of table
        table = jnp.zeros((2, pages), jnp.int32)
        kernels.paged_attention(q, k8, v8, lens, table, interpret=True, **scales)
        kernels.ragged_paged_attention(q, k8, v8, jnp.arange(3), lens, table, interpret=True,
                                       **scales)
    tiles = [(kw["pages_per_block"], kw["num_stages"]) for kw in seen]
    assert tiles == [(4, 3)] * 2 + [(8, 2)] * 2
    assert "long" not in seen[-1] and seen[-1]["hoist_decode"]


def test_write_kv_quantizes():
    """The write kernel stores K / scale as float8 like the reference (saturating, not NaN, on
    overflow), V in its keys-last pages, and drops padding."""
    from pallasite.kernels import kv_write
    rng = np.random.default_rng(1)
    KV, P, page, D, T = 2, 4, 8, 16, 5
    pages = jnp.zeros((KV, P, page, D), jnp.float8_e4m3fn)
    v_pages = jnp.zeros((KV, P, D, page), jnp.float8_e4m3fn)
    k = jnp.asarray(rng.standard_normal((T, KV, D)) * 3, jnp.bfloat16).at[0, 0, 0].set(1e4)
    v = jnp.asarray(rng.standard_normal((T, KV, D)), jnp.bfloat16)
    slots = jnp.asarray([3, 9, -1, 30, 0], jnp.int32)
    scales = jnp.asarray([0.5, 2.0]).reshape(KV, 1, 1, 1), jnp.asarray([0.01, 0.1])
    out = kv_write.write_kv(pages, v_pages, k, v, slots, k_scale=scales[0], v_scale=scales[1],
                            interpret=True)
    ref = reference.write_kv_reference(pages, v_pages, k, v, slots, k_scale=scales[0],
                                       v_scale=scales[1])
    for o, r in zip(out, ref):
        assert o.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
    kf = np.asarray(out[0], np.float32)
    assert kf[0, 0, 3, 0] == 448.0  # 1e4 / 0.5 saturates to e4m3's largest finite value
    np.testing.assert_allclose(kf[1, 1, 1] * 2.0, np.asarray(k[1, 1], np.float32), rtol=0.07)
    assert np.count_nonzero(kf) == np.count_nonzero(np.asarray(ref[0], np.float32))
    vf = np.asarray(out[1], np.float32)  # slot 9: page 1, offset 1, a column of each head
    np.testing.assert_allclose(vf[:, 1, :, 1] * np.asarray([[0.01], [0.1]]),
                               np.asarray(v[1], np.float32), rtol=0.07, atol=1e-3)


def test_options_lower_for_gpu():
    """Soft-cap (tanh), sinks, windows and float8 pages reach Triton IR without a GPU."""
    from pallasite.kernels import kv_write
    sds = jax.ShapeDtypeStruct
    q, f8 = sds((8, 32, 128), jnp.bfloat16), sds((8, 64, 16, 128), jnp.float8_e4m3fn)
    v8 = sds((8, 64, 128, 16), jnp.float8_e4m3fn)  # keys-last
    i32, f32 = (lambda *shape: sds(shape, jnp.int32)), (lambda *shape: sds(shape, jnp.float32))
    for decode, fp8_dot in ((True, "q"), (False, "q"), (True, "f16"), (False, "f16"),
                            (True, "fma"), (True, "fma_rows"), (False, "fma_rows"),
                            (True, "e4m3")):
        text = paged.ragged_paged_attention.trace(
            q, f8, v8, i32(9), i32(8), i32(8, 8), sliding_window=100, logit_softcap=30.0,
            sinks=f32(32), k_scale=f32(8), v_scale=f32(8), num_splits=2, block_rows=1,
            fp8_dot=fp8_dot, one_token_per_seq=decode).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("@__gpu$xla.gpu.triton") == 2
    x = sds((1, 64, 4, 64), jnp.bfloat16)
    text = flash.flash_attention.trace(x, x, x, sliding_window=16, logit_softcap=50.0,
                                       sinks=f32(4)).lower(lowering_platforms=("cuda",))
    assert "pallasite_flash_attention" in text.as_text()
    rows = sds((5, 8, 128), jnp.bfloat16)
    text = kv_write.write_kv.trace(f8, v8, rows, rows, i32(5), k_scale=f32(8), v_scale=f32(8))
    assert "pallasite_kv_write" in text.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("window,softcap,sinks,fp8", [(20, None, False, False),
                                                      (9, 30.0, True, True),
                                                      (None, None, True, True)])
def test_ragged_jnp_options(window, softcap, sinks, fp8):
    """The CPU serving path (blockwise jnp) takes the options like the reference."""
    from pallasite.kernels import ragged_jnp
    q, kp, vp, qs, ctx, table, *_ = windowed_case(3, [13, 1, 5, 1], [60, 80, 0, 9], 8, 2, 16, 8,
                                                  window, pad_tokens=2)
    opts = dict(sliding_window=window, logit_softcap=softcap,
                sinks=jnp.linspace(-1.0, 2.0, 8) if sinks else None)
    if fp8:
        scale = jnp.asarray([0.02, 0.5])
        kp, vp = quantized(kp, scale), quantized(vp, scale, v=True)
        opts |= dict(k_scale=scale, v_scale=scale.reshape(2, 1, 1, 1))
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table, **opts)
    out = ragged_jnp.ragged_paged_attention(q, kp, vp, qs, ctx, table, pages_per_block=2, **opts)
    assert rel_err(out, ref) < 1e-5
