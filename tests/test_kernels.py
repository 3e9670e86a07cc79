"""Pallas attention kernels in interpret mode against their jnp references.

Interpret mode fills every output buffer with NaN before the kernel runs, so an element that no
program writes fails the comparison. Inputs are fresh random numbers for each case (never zeros);
shapes include lengths 1 and primes that are multiples of no block or page size, zero-length
sequences, padding slots, GQA ratios 1, 4 and 8, shuffled pages, page sizes 16 and 32.
Small head dims keep the interpreter fast.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import flash, flash_mgpu, paged, reference


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output (an element no program wrote?)"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def paged_case(seed, q_lens, cached, H, KV, D, page_size, pad_tokens=0, spare_pages=3):
    """Random ragged batch: sequence s has q_lens[s] new tokens after cached[s] cached ones."""
    rng = np.random.default_rng(seed)
    q_lens, cached = np.asarray(q_lens), np.asarray(cached)
    ctx = (q_lens + cached).astype(np.int32)
    pps = max(1, math.ceil(max(ctx.max(), 1) / page_size)) + 1  # a spare table column
    S = len(ctx)
    P = S * pps + spare_pages
    table = rng.permutation(P)[: S * pps].reshape(S, pps).astype(np.int32)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qs[-1]) + pad_tokens
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kp = rng.standard_normal((KV, P, page_size, D)).astype(np.float32)
    vp = rng.standard_normal((KV, P, page_size, D)).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (q, kp, vp, qs, ctx, table))


FLASH_CASES = [
    # B, T, S, H, KV, D, causal, segments, block_q, block_k
    (2, 37, 37, 4, 1, 32, True, False, 16, 16),   # MQA, prime length
    (1, 53, 53, 8, 2, 16, False, False, 32, 16),  # GQA 4, full
    (2, 45, 45, 8, 1, 32, True, True, 16, 32),    # GQA 8, packed documents
    (1, 1, 1, 4, 4, 16, True, False, 16, 16),     # length 1
    (1, 19, 61, 4, 4, 32, True, False, 16, 16),   # T < S: last query meets last key
    (1, 29, 29, 4, 2, 64, False, True, 16, 16),   # full attention within documents
]


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attention(case):
    B, T, S, H, KV, D, causal, segments, bq, bk = case
    rng = np.random.default_rng(T * 31 + S)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, KV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, KV, D)), jnp.float32)
    seg = None
    if segments:
        seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.15, axis=1), jnp.int32)
    out = flash.flash_attention(q, k, v, seg, causal=causal, block_q=bq, block_k=bk,
                                interpret=True)
    ref = reference.attention_reference(q, k, v, causal=causal, segment_ids=seg)
    assert rel_err(out, ref) < 1e-5


def test_flash_attention_bf16_through_dispatch():
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((1, 23, 8, 32)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 23, 2, 32)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 23, 2, 32)), jnp.bfloat16)
    out = kernels.flash_attention(q, k, v, causal=True, interpret=True, block_q=16, block_k=16)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, reference.attention_reference(q, k, v, causal=True)) < 1e-2


MOSAIC_CASES = [
    # B, T, S, H, KV, D, causal, block_kv, num_stages, dtype, num_ctas
    (1, 128, 128, 4, 1, 64, False, 64, 2, jnp.bfloat16, None),  # full, GQA 4, a tile per CTA
    (1, 128, 256, 2, 2, 64, True, 64, 2, jnp.float16, 1),       # S > T: consumer 0 drains a tile
    (1, 256, 256, 1, 1, 64, True, 64, 3, jnp.bfloat16, 1),      # heaviest first, ring wraps
    (2, 128, 192, 2, 1, 128, False, 64, 2, jnp.bfloat16, 3),    # head_dim 128, idle CTA slot
    (2, 256, 320, 2, 1, 64, True, 64, 2, jnp.bfloat16, 3),      # snake order over 8 tiles
    (1, 128, 64, 1, 1, 64, False, 64, 2, jnp.bfloat16, None),   # a single key tile
    (1, 256, 384, 2, 1, 64, True, 128, 2, jnp.bfloat16, 2),     # consumer 0's half diagonals
]


def run_mosaic_case(case, seed, **kw):
    """(output, its relative error against the reference) of the Mosaic GPU flash kernel in
    the interpreter on a MOSAIC_CASES case with fresh random inputs."""
    B, T, S, H, KV, D, causal, bk, stages, dtype, ctas = case
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, T, H, D), (B, S, KV, D), (B, S, KV, D)))
    out = flash_mgpu.flash_attention(q, k, v, causal=causal, block_q=64, block_kv=bk,
                                     num_stages=stages, num_ctas=ctas, interpret=True, **kw)
    return out, rel_err(out, reference.attention_reference(q, k, v, causal=causal))


@pytest.mark.parametrize("case", MOSAIC_CASES)
def test_flash_mosaic_interpret(case):
    """The Mosaic GPU kernel's persistent tile loop, TMA ring (carried across tiles), barriers
    (every phase observed by every warpgroup, as the interpreter checks), masks and online
    softmax; its wgmma calls run as plain dots here and are checked on the GPU only."""
    B, T, S, H = case[:4]
    out, err = run_mosaic_case(case, T + S + H)
    assert out.dtype == case[9]
    assert err < 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_flash_mosaic_work_list_covers_every_tile_once_band_by_band(causal):
    """Bands of GQA groups: every (batch, head, query tile) once, one band's heads finished
    before the next band's start, the heaviest causal tiles first within a band."""
    T, H, B, block_q, ctas, band = 512, 8, 2, 64, 5, 4  # 4 query tiles of 128 rows
    locate, rounds = flash_mgpu._tiles(T, H, B, block_q, causal, ctas, band)
    order = []
    for i in range(rounds):
        for cta in range(ctas):
            valid, b, h, tile = (int(x) for x in locate(jnp.int32(cta), jnp.int32(i)))
            if valid:  # the item's place in the work list: rounds run in snake order
                order.append((i * ctas + (cta if i % 2 == 0 else ctas - 1 - cta), b, h, tile))
    seen = sorted((b, h, t) for _, b, h, t in order)
    assert seen == [(b, h, t) for b in range(B) for h in range(H) for t in range(4)]
    by_round = [x for _, *x in sorted(order)]
    assert [h // band for _, h, _ in by_round] == sorted(h // band for _, h, _ in by_round)
    tiles = [t for _, _, t in by_round[:B * band * 4]]
    assert tiles == sorted(tiles, reverse=causal)


def test_flash_mosaic_bands_interpret():
    """The kernel with its heads in two bands (band_kv=1 of 2 KV heads) equals the reference."""
    case = (2, 128, 128, 4, 2, 64, True, 64, 2, jnp.bfloat16, 3)
    assert run_mosaic_case(case, 7, band_kv=1)[1] < 1e-2
    assert flash_mgpu.band_kv_heads(1, 16384, 8, 128, 2) == 2  # 8 MB of K/V a head
    assert flash_mgpu.band_kv_heads(1, 4096, 8, 128, 2) == 8
    assert flash_mgpu.band_kv_heads(1, 16384, 8, 128, 2, causal=True) == 8


@pytest.mark.parametrize("case", [MOSAIC_CASES[i] for i in (1, 4, 6)])
def test_flash_mosaic_sum_in_softmax_interpret(case):
    """`late_sum=False`: P's row sums taken in the softmax, not while P V runs."""
    B, T, S, H = case[:4]
    assert run_mosaic_case(case, T * S + H + 1, late_sum=False)[1] < 1e-2


@pytest.mark.parametrize("case", [MOSAIC_CASES[i] for i in (1, 3, 4)])
def test_flash_mosaic_overlap_interpret(case):
    """The software-pipelined consumers: S(j) and P(j-1) V(j-1) issued in one turn, the two
    consumers passing turns through their own barriers, drains taking turns too."""
    B, T, S, H = case[:4]
    assert run_mosaic_case(case, T * S + H, overlap=True)[1] < 1e-2


@pytest.mark.parametrize("B,T,H,KV,D,causal,dtype,kw", [
    (4, 4096, 32, 8, 128, True, jnp.bfloat16, {}),                 # the benchmark shape
    (2, 1024, 8, 8, 64, False, jnp.float16, dict(num_ctas=1 << 20)),  # one CTA per tile
    (1, 512, 4, 1, 128, True, jnp.bfloat16, dict(block_kv=64, num_stages=3)),
    (4, 4096, 32, 8, 128, True, jnp.bfloat16, dict(overlap=True)),
    (2, 1024, 8, 2, 128, False, jnp.float16, dict(overlap=True)),
    (4, 4096, 32, 8, 128, True, jnp.bfloat16, dict(late_sum=False)),
])
def test_flash_mosaic_lowers_for_hopper(B, T, H, KV, D, causal, dtype, kw):
    """Mosaic GPU's lowering for sm_90 without a GPU: TMA descriptors, smem tiling, register
    layouts and the wgmma calls that interpret mode replaces, though not the final compile."""
    q = jax.ShapeDtypeStruct((B, T, H, D), dtype)
    k = jax.ShapeDtypeStruct((B, T, KV, D), dtype)
    lowered = flash_mgpu.flash_attention.trace(q, k, k, causal=causal, **kw).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_flash_backend_choice():
    q = jnp.zeros((1, 256, 8, 128), jnp.bfloat16)
    k = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    assert kernels.flash_backend(q, k) == "triton"  # no Hopper GPU here
    assert kernels.flash_backend(q, k, backend="mosaic") == "mosaic"
    with pytest.raises(ValueError, match="segment ids"):
        kernels.flash_backend(q, k, segment_ids=jnp.zeros((1, 256), jnp.int32), backend="mosaic")
    for q_, k_ in ((q[:, :100], k), (q, k[:, :0])):  # T off the tiles; no keys at all
        with pytest.raises(ValueError, match="not a positive multiple"):
            kernels.flash_backend(q_, k_, backend="mosaic")
    with pytest.raises(ValueError, match="dtype"):
        kernels.flash_backend(q.astype(jnp.float32), k.astype(jnp.float32), backend="mosaic")
    with pytest.raises(ValueError, match="one of"):
        kernels.flash_backend(q, k, backend="cuda")


RAGGED_CASES = [
    # q_lens, cached, H, KV, D, page_size, pad, splits, block_rows, pages_per_block
    ([5, 1, 0, 17, 1], [3, 40, 7, 0, 0], 4, 1, 32, 16, 3, 1, 16, 2),   # MQA, zero-length seq
    ([13, 1, 1, 0, 7], [29, 0, 52, 0, 31], 8, 2, 16, 16, 2, 3, 16, 1),  # GQA 4, split-K
    ([1, 1, 1, 1], [30, 0, 63, 96], 8, 1, 32, 32, 0, 2, 16, 1),         # decode only, GQA 8
    ([31, 2], [50, 20], 4, 4, 16, 32, 5, 1, 32, 2),                     # GQA 1, page 32
    ([11, 1, 3], [0, 70, 41], 8, 1, 16, 16, 0, 4, 64, 4),               # 64 rows, 4 splits
    # decode rows first, as a step packs them (their blocks run as decode blocks), a chunk,
    # then a one-token row after it (a ragged block)
    ([1, 1, 1, 9, 1, 4], [30, 70, 5, 40, 12, 0], 8, 2, 16, 16, 3, 2, 16, 1),
]


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_paged_attention(case):
    q_lens, cached, H, KV, D, page_size, pad, splits, rows, ppb = case
    q, kp, vp, qs, ctx, table = paged_case(sum(q_lens) + len(cached), q_lens, cached, H, KV, D,
                                           page_size, pad_tokens=pad)
    out = paged.ragged_paged_attention(q, kp, vp, qs, ctx, table, num_splits=splits,
                                       block_rows=rows, pages_per_block=ppb, interpret=True)
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out[int(qs[-1]):]) == 0)  # padding slots give zeros


@pytest.mark.parametrize("ctx,H,KV,page_size,splits", [
    ([1, 37, 0, 64, 17], 8, 2, 16, 1),   # context 0 gives zeros
    ([101, 2, 53], 4, 4, 32, 3),
    ([200], 8, 1, 16, 8),                # batch 1, many splits
])
def test_paged_attention(ctx, H, KV, page_size, splits):
    cached = np.maximum(np.asarray(ctx) - 1, 0)
    q, kp, vp, _, _, table = paged_case(sum(ctx), [1] * len(ctx), cached, H, KV, 32, page_size)
    ctx = jnp.asarray(ctx, jnp.int32)
    out = paged.paged_attention(q, kp, vp, ctx, table, num_splits=splits, pages_per_block=2,
                                interpret=True)
    ref = reference.paged_attention_reference(q, kp, vp, ctx, table)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("splits,R,live,group,stride", [
    (3, 40, 40, None, None), (16, 37, 30, None, None), (5, 64, 64, 4, 8), (2, 48, 30, 6, 8)])
def test_merge_splits(splits, R, live, group, stride):
    """The one-launch split merge against `_combine`: empty splits (NEG_INF) weigh nothing,
    rows from `live` on are zeros, padded head groups lose their padding rows."""
    rng = np.random.default_rng(splits * R)
    o = jnp.asarray(rng.standard_normal((splits, R, 32)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((splits, R)) * 4, jnp.float32)
    lse = lse.at[0, ::3].set(reference.NEG_INF).at[:, 1].set(reference.NEG_INF)
    out = paged.merge_splits(o, lse, live, jnp.float32, group=group, stride=stride,
                             interpret=True)
    ref = paged._combine(o, lse)
    if group:
        ref = ref.reshape(R // stride, stride, -1)[:, :group].reshape(-1, 32)
    ref = jnp.where((jnp.arange(ref.shape[0]) < live)[:, None], ref, 0)
    assert out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.asarray(out[live:]) == 0)


@pytest.mark.parametrize("splits,decode", [(1, True), (4, True), (1, False), (3, False)])
def test_paged_triton_lowers_for_gpu(splits, decode):
    """The Triton lowering without a GPU: index arithmetic of the in-place q gather and output
    scatter, and the split merge, reach Triton IR; decode is one launch, two with splits."""
    q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 64, 16, 128), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    text = paged.ragged_paged_attention.trace(
        q, pages, pages, i32(9), i32(8), i32(8, 8), num_splits=splits,
        one_token_per_seq=decode).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@__gpu$xla.gpu.triton") == 1 + (splits > 1)
    if decode:  # no metadata, packing or unpacking around the launches
        assert "stablehlo.transpose" not in text and "stablehlo.iota" not in text


def test_split_heuristic():
    """Split-K aims for a few programs per SM, capped by the tiles and max_splits; mixed
    prefill + decode steps aim for more, with 8 key tiles a split at least (tuning.py)."""
    from pallasite.kernels import tuning
    assert tuning.num_splits(64 * 8, 64) == 1            # batch 64: the grid is full
    assert tuning.num_splits(8 * 8, 64) == 4             # batch 8: two programs per SM
    assert tuning.num_splits(64 * 8, 64, mixed=True) == 2
    assert tuning.num_splits(1 * 8, 512) == 16           # batch 1: capped at max_splits
    assert tuning.num_splits(1 * 8, 3) == 3              # no more splits than key tiles
    assert tuning.num_splits(4096, 64, mixed=True) == 1  # a long prefill fills the grid
    assert tuning.num_splits(16 * 8, 10, mixed=True) == 1  # a mixed split: 8 tiles at least
    assert tuning.num_splits(16 * 8, 40, mixed=True) == 5


def test_decode_needs_one_token_per_sequence():
    q, kp, vp, _, ctx, table = paged_case(3, [1, 1], [20, 9], 8, 2, 16, 16)
    with pytest.raises(ValueError, match="one token per sequence"):
        paged.ragged_paged_attention(q[:1], kp, vp, jnp.arange(3), ctx, table,
                                     one_token_per_seq=True, interpret=True)


def test_paged_dispatch_defaults_and_context_zero():
    q, kp, vp, _, ctx, table = paged_case(3, [1, 1, 1], [20, 0, 45], 8, 2, 16, 16)
    ctx = ctx.at[1].set(0)
    out = kernels.paged_attention(q, kp, vp, ctx, table, interpret=True)
    ref = reference.paged_attention_reference(q, kp, vp, ctx, table)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out[1]) == 0)
    out = kernels.ragged_paged_attention(q, kp, vp, jnp.arange(4, dtype=jnp.int32), ctx, table,
                                         interpret=True)
    assert rel_err(out, ref) < 1e-5


def test_block_metadata():
    qs = jnp.asarray([0, 5, 5, 6, 23, 23], jnp.int32)  # lengths 5, 0, 1, 17, 0
    seq, tok = paged.block_metadata(qs, 4, 12)  # 25 tokens: 23 and 2 of padding
    # blocks: seq 0 -> tokens 0, 4; seq 2 -> 5; seq 3 -> 6, 10, 14, 18, 22; then padding
    # blocks (sequence 5, none) over the tokens from 23 on, which the kernel zeroes
    assert list(np.asarray(seq)) == [0, 0, 2, 3, 3, 3, 3, 3] + [5] * 4
    assert list(np.asarray(tok)) == [0, 4, 5, 6, 10, 14, 18, 22, 23, 27, 31, 35]
    # blocks with a token below T: the 8 real ones, then one of padding (tokens 23-26)
    assert [int(paged.block_metadata(qs, 4, 12, T)[2][0]) for T in (23, 25, 27, 28, 99)] == [
        8, 9, 9, 10, 12]
    # leading sequences of one token: none here; all of a decode step; up to the first chunk
    lead = lambda lens: int(paged.block_metadata(
        jnp.asarray(np.cumsum([0] + lens), jnp.int32), 4, 12, 30)[2][1])
    assert (lead([5, 0, 1, 17, 0]), lead([1, 1, 1]), lead([1, 1, 7, 1]), lead([1, 0, 1])) == (
        0, 3, 2, 1)


def test_split_combine_matches_single_pass():
    q, kp, vp, qs, ctx, table = paged_case(11, [3, 1], [90, 40], 4, 2, 16, 16)
    one = paged.ragged_paged_attention(q, kp, vp, qs, ctx, table, num_splits=1, block_rows=16,
                                       pages_per_block=1, interpret=True)
    many = paged.ragged_paged_attention(q, kp, vp, qs, ctx, table, num_splits=5, block_rows=16,
                                        pages_per_block=1, interpret=True)
    assert rel_err(many, one) < 1e-5


@pytest.mark.parametrize("window, cached", [(None, 300), (100, 700)])
def test_batch_invariant_splits_score_a_verify_row_as_its_decode_step(window, cached):
    """Speculative verification: sequence 0's 5 tokens in a step padded to 8 sequences score
    bit for bit what each scores alone in a 2-sequence decode step with a narrower page table.
    The default split heuristic gives those calls different splits (so different sums); the
    fixed 512-key splits of `batch_invariant` do not, a window's start moved back to a split
    boundary included (700 cached tokens). bf16, as served."""
    from pallasite.kernels import tuning
    q, kp, vp, _, _, table = paged_case(13, [5] * 8, [cached] * 8, 8, 4, 16, 16)
    q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))

    def step(rows, ctx, S, width):  # sequence 0 has `rows`; the rest of the S are empty
        T = 8 if S == 8 else 2
        x = jnp.concatenate([rows, jnp.zeros((T - len(rows), *q.shape[1:]), q.dtype)])
        qs = jnp.asarray([0] + [len(rows)] * S, jnp.int32)
        lens = jnp.asarray([ctx] + [0] * (S - 1), jnp.int32)
        return kernels.ragged_paged_attention(x, kp, vp, qs, lens, table[:S, :width],
                                              pages_per_block=2, sliding_window=window,
                                              interpret=True)

    width = table.shape[1]
    with tuning.batch_invariant():
        verify = step(q[:5], cached + 5, 8, width)
        for j in range(5):
            alone = step(q[j:j + 1], cached + 1 + j, 2, width - j % 2)
            np.testing.assert_array_equal(np.asarray(verify[j], np.float32),
                                          np.asarray(alone[0], np.float32))


def test_cpu_dispatch_uses_reference():
    assert kernels.choose_impl() == "reference"
    assert kernels.choose_impl("pallas") == "pallas"
    with pytest.raises(ValueError):
        kernels.choose_impl("cuda")
    q, kp, vp, qs, ctx, table = paged_case(5, [4, 1], [6, 9], 4, 2, 16, 16, pad_tokens=2)
    out = jax.jit(kernels.ragged_paged_attention)(q, kp, vp, qs, ctx, table)
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_write_kv_drops_padding():
    rng = np.random.default_rng(3)
    kp = jnp.asarray(rng.standard_normal((2, 4, 16, 8)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((2, 4, 16, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    slots = jnp.asarray([37, -1, 5], jnp.int32)
    k2, v2 = kernels.write_kv(kp, vp, k, v, slots)
    np.testing.assert_array_equal(np.asarray(k2[:, 2, 5]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(v2[:, 0, 5]), np.asarray(v[2]))
    changed = np.asarray(k2 != kp).any(axis=(0, 3))
    assert changed.sum() == 2  # the padding slot wrote nothing


@pytest.mark.parametrize("T,page_size,pad", [(1, 16, []), (13, 16, [0, 6, 12]), (7, 32, [3])])
def test_kv_write_kernel_matches_scatter(T, page_size, pad):
    """The Pallas KV write (interpret mode): the same pages as XLA's scatter, bit for bit, on
    random pages and rows (float32 rows into bf16 pages), padding tokens writing nothing."""
    rng = np.random.default_rng(T + page_size)
    KV, P, D = 2, 7, 64
    kp, vp = (jnp.asarray(rng.standard_normal((KV, P, page_size, D)), jnp.bfloat16)
              for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((T, KV, D)), jnp.float32) for _ in range(2))
    slots = np.asarray(rng.permutation(P * page_size)[:T], np.int32)
    slots[pad] = -1
    out = kernels.write_kv(kp, vp, k, v, jnp.asarray(slots), interpret=True)
    ref = reference.write_kv_reference(kp, vp, k, v, jnp.asarray(slots))
    for o, r, before in zip(out, ref, (kp, vp)):
        assert o.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
    written = np.asarray(out[0] != kp).any(axis=(0, 3)).sum()
    assert written == T - len(pad)


def test_kv_write_lowers_for_gpu():
    """The kernel's Triton lowering (scatter through an all-array index, pages aliased to the
    outputs) without a GPU."""
    from pallasite.kernels import kv_write
    pages = jax.ShapeDtypeStruct((8, 64, 16, 128), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((5, 8, 128), jnp.bfloat16)
    lowered = kv_write.write_kv.trace(pages, pages, rows, rows, jax.ShapeDtypeStruct(
        (5,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "pallasite_kv_write" in lowered.as_text()


def test_profile_phase_times_pairs_nested_events():
    """profiling/profile_flash.py's reading of a trace: begin/end pairs per warpgroup thread,
    nested phases closed innermost first, warpgroups told apart by their trace id."""
    from profiling.profile_flash import phase_times
    ev = lambda name, ph, ts, tid: dict(name=name, ph=ph, ts=ts, tid=tid, pid=1)
    trace = {"traceEvents": [
        ev("qk", "B", 0.0, 1), ev("softmax", "B", 1.0, 1), ev("softmax", "E", 3.5, 1),
        ev("qk", "E", 4.0, 1),
        ev("pv", "B", 2.0, 2), ev("pv", "E", 2.5, 2),
        ev("pv", "B", 0.5, 5), ev("pv", "E", 1.0, 5),  # second CTA, its consumer 1
    ]}
    t = phase_times(trace)
    assert t[("consumer 0", "qk")] == [4.0]
    assert t[("consumer 0", "softmax")] == [2.5]
    assert sorted(t[("consumer 1", "pv")]) == [0.5, 0.5]


def test_ncu_summary_reads_each_kernel(tmp_path, capsys):
    """profiling/ncu_flash.py's reading of Nsight Compute's source page: one block per profiled
    kernel, stall reasons and opcodes as shares of that kernel's samples, predicates skipped."""
    from profiling.ncu_flash import summarize
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","stall_wait",'
            '"stall_long_sb","stall_wait (Not Issued)"\n')
    kernel = lambda rows: '"Kernel Name","k",\n' + head + "".join(
        f'"0x{i}","{src}","{n}","{w}","{n - w}","0"\n' for i, (src, n, w) in enumerate(rows))
    path = tmp_path / "sass.csv"
    path.write_text(kernel([("FADD R1, R2, R3", 30, 30), ("@!P1  BRA 0x10", 70, 0)])
                    + kernel([("MUFU.EX2 R1, R1", 5, 5)]))
    summarize(str(path))
    out = capsys.readouterr().out
    assert "kernel 0: 2 instructions, 100 samples" in out
    assert "long_sb 70%, wait 30%" in out and "BRA 70%, FADD 30%" in out
    assert "kernel 1: 1 instructions, 5 samples" in out and "MUFU 100%" in out


def test_ncu_decode_summary_groups_kernels_by_call(tmp_path, capsys):
    """profiling/ncu_decode.py's reading of Nsight Compute's metric CSV: the kernels after each
    marker belong to that call; durations (ns) and bytes sum per call."""
    from profiling.ncu_decode import summarize
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [(0, "marker_b1_triton", 1000, 0), (1, "pack_fusion", 2000, 1e6),
            (2, "pallasite_ragged", 60000, 134e6), (3, "marker_b1_read", 1000, 0),
            (4, "reduce", 50000, 134e6)]
    body = "".join(f'"{i}","{n}","gpu__time_duration.sum","ns","{t:,}"\n'
                   f'"{i}","{n}","dram__bytes_read.sum","byte","{b:,.0f}"\n'
                   for i, n, t, b in rows)
    path = tmp_path / "k.csv"
    path.write_text("==PROF== Disconnected\n" + head + body)
    summarize(str(path))
    out = capsys.readouterr().out
    assert "| b1_triton | 2 | 62.00 | 135.0 | 2.18 |" in out
    assert "| b1_read | 1 | 50.00 | 134.0 | 2.68 |" in out


def test_device_time_cuts_trace_at_flushes():
    """benchmarks/common.py's device timing: kernels on the GPU's stream lines between
    flushes make one call; other planes and derived lines are not counted twice."""
    from types import SimpleNamespace as E
    from benchmarks.common import FLUSH, per_call_ms
    ev = lambda t, ns, name: E(start_ns=t, duration_ns=ns, name=name)
    stream = [ev(0, 500, FLUSH), ev(600, 40_000, "attn"), ev(41_000, 3_000, "merge"),
              ev(50_000, 500, FLUSH), ev(51_000, 50_000, "attn"), ev(102_000, 4_000, "merge"),
              ev(110_000, 500, FLUSH), ev(111_000, 45_000, "attn"), ev(157_000, 2_000, "merge")]
    lines = [("/device:GPU:0", "Stream #13(Compute)", stream),
             ("/device:GPU:0", "XLA Ops", [ev(600, 43_000, "custom-call")]),
             ("/host:CPU", "python", [ev(0, 10**6, "call")])]
    ms, names = per_call_ms(lines, 3)
    assert ms == pytest.approx(0.047) and names == ["attn", "merge"]
    with pytest.raises(RuntimeError, match="3 flushes for 4 calls"):
        per_call_ms(lines, 4)


@pytest.mark.parametrize("mode", ["read", "write"])
def test_bench_l2_flush_kernels(mode, monkeypatch):
    """Both L2 flushes lower to one Triton kernel named FLUSH (how a trace is cut into calls);
    the read flush returns column sums of its 128 MB buffer of ones, the write flush 128 MB."""
    from benchmarks import common as bk
    monkeypatch.setitem(bk.FLUSH_MODE, "mode", mode)
    flush = bk.l2_flush()
    text = jax.jit(lambda: flush()).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert bk.FLUSH in text and "triton" in text
    out = jax.eval_shape(flush)
    assert out.size * 4 == (2 << 20 if mode == "read" else 128 << 20)


def test_bench_table_rows():
    """benchmarks/bench_kernels.py's report: a decode row where JAX's kernel failed shows no ratio,
    and KV-write records get their own table."""
    from benchmarks.bench_kernels import table
    base = dict(gpu="GPU", jax_version="0", date="d")
    decode = dict(base, kernel="paged_attention", batch=1, context=32768, page_size=64,
                  backend="triton", ours_ms=0.0627, tbps=2.14, frac_of_copy_bw=0.71,
                  baselines={"jnp_dense": 0.0703}, speedup_vs_jax_paged=None, rel_err=0.0019)
    kv = dict(base, kernel="kv_write", batch=64, ours_ms=0.0034,
              baselines={"xla_scatter": 0.0049}, same_as_xla=True)
    out = table([decode, kv], 3.0)
    assert "| B=1 ctx=32768 page=64 | triton | 0.0627 | 2.14 | 71% | - | - | 0.0703 |" in out
    assert "| T=64 tokens | 0.0034 | 0.0049 | True |" in out


def test_heads_past_128_take_tiles_of_the_same_bytes():
    """Gemma's head dim 256: the flash, ragged and decode tiles shrink so a pipeline stage holds
    what it holds at 128 (the 128-dim tiles asked 448 KB of shared memory on an H200); heads of
    128 and below keep the table's tiles."""
    from pallasite.kernels import tuning
    for name, page_size in (("flash", None), ("ragged", 16), ("decode", 16), ("decode_fp8", 16)):
        narrow = tuning.params(name, page_size, 256, head_dim=128)
        wide = tuning.params(name, page_size, 256, head_dim=256)
        assert narrow == tuning.params(name, page_size, 256)
        size = lambda p: (p.get("block_q", 1) * p.get("block_k", 1)
                          * p.get("pages_per_block", 1) * p.get("block_rows", 1))
        assert 2 * size(wide) <= size(narrow), (name, wide, narrow)
