"""The Mosaic GPU paged decode kernel in Pallas's Mosaic GPU interpreter against the jnp reference.

The interpreter runs the grid, the page-table reads, the TMA ring and its barriers (it checks that
every warpgroup observes every phase of the barriers it waits on), the masks and the online
softmax as written; the two wgmma products run as plain dots, so they are checked on the GPU
only. Inputs are fresh random numbers (never zeros) on shuffled pages; contexts include 0, 1,
primes and exact multiples of the key tile. Every interpreted CTA costs about a second, so the
grids stay small. A last test lowers the kernel for Hopper (sm_90) without a GPU: that runs the
Mosaic GPU lowering rules (TMA descriptors, smem tiling and slicing, register layouts, wgmma)
that interpret mode skips, though not the final compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallasite.kernels import paged_mgpu, reference
from test_kernels import paged_case, rel_err


def decode_case(seed, ctx, H, KV, D, page_size, dtype):
    """q [S, H, D] and a shuffled page pool holding sequences of lengths `ctx`."""
    cached = np.maximum(np.asarray(ctx) - 1, 0)
    q, kp, vp, _, _, table = paged_case(seed, [1] * len(ctx), cached, H, KV, D, page_size)
    return (q.astype(dtype), kp.astype(dtype), vp.astype(dtype), jnp.asarray(ctx, jnp.int32),
            table)


def poison_stale_slots(pages, ctx, table):
    """NaN in every pool slot that holds no live key: the rest of each last page, the pages the
    table lists past a sequence's end, and the pages no sequence owns."""
    page_size = pages.shape[2]
    live = np.zeros(pages.shape[1:3], bool)
    for s, n in enumerate(np.asarray(ctx)):
        for i in range(int(n)):
            live[table[s, i // page_size], i % page_size] = True
    return jnp.where(jnp.asarray(live)[None, :, :, None], pages, jnp.nan).astype(pages.dtype)


CASES = [
    # ctx, H, KV, D, page_size, splits, block_k, stages, dtype
    ([1, 37, 0], 4, 1, 64, 16, 1, 64, 4, jnp.bfloat16),      # GQA 4, context 0 and 1
    ([200], 2, 2, 64, 16, 1, 64, 2, jnp.float16),            # GQA 1, 4 tiles through 2 slots
    ([53], 8, 1, 128, 32, 3, 64, 4, jnp.bfloat16),           # GQA 8, more splits than tiles
    ([131, 64], 4, 1, 64, 32, 2, 64, 2, jnp.bfloat16),       # split-K, ctx a tile multiple
    ([97], 4, 1, 64, 16, 1, 128, 2, jnp.float16),            # 128-key tiles: 8 pages a tile
    ([150], 4, 1, 64, 128, 2, 64, 2, jnp.bfloat16),          # pages of two tiles each
]


@pytest.mark.parametrize("case", CASES)
def test_paged_mgpu_interpret(case):
    ctx, H, KV, D, page_size, splits, bk, stages, dtype = case
    q, kp, vp, ctx, table = decode_case(sum(ctx) + H, ctx, H, KV, D, page_size, dtype)
    out = paged_mgpu.paged_attention(q, kp, vp, ctx, table, num_splits=splits, block_k=bk,
                                     num_stages=stages, interpret=True)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference.paged_attention_reference(q, kp, vp, ctx, table)
    assert rel_err(out, ref) < 1e-2
    for s in np.flatnonzero(np.asarray(ctx) == 0):
        assert np.all(np.asarray(out[s]) == 0)


def test_paged_mgpu_nan_in_stale_slots(splits=2):
    """Keys past a sequence's length weigh nothing even when the pool holds NaN there (split:
    the masked tiles of both the split programs and the merge)."""
    q, kp, vp, ctx, table = decode_case(17, [45, 1, 83], 4, 1, 64, 16, jnp.bfloat16)
    ref = reference.paged_attention_reference(q, kp, vp, ctx, table)
    t = np.asarray(table)
    kp_nan, vp_nan = poison_stale_slots(kp, ctx, t), poison_stale_slots(vp, ctx, t)
    assert np.isnan(np.asarray(vp_nan, np.float32)).any()
    # Table entries past a sequence's pages are garbage: the kernel must not follow them.
    n_pages = -(-np.asarray(ctx) // kp.shape[2])
    t = np.where(np.arange(t.shape[1])[None] < n_pages[:, None], t, 2**30).astype(np.int32)
    out = paged_mgpu.paged_attention(q, kp_nan, vp_nan, ctx, jnp.asarray(t),
                                     num_splits=splits, interpret=True)
    assert rel_err(out, ref) < 1e-2  # rel_err fails on any non-finite element


RAGGED_CASES = [
    # q_lens, cached, H, KV, D, page_size, splits, block_k, pad_tokens
    ([33, 1], [70, 12], 4, 1, 64, 16, 2, 64, 0),           # a chunk over cached keys, split-K
    ([5, 9], [0, 58], 2, 2, 64, 32, 1, 64, 2),             # groups of 1: 64 tokens a block
]


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_ragged_mgpu_interpret(case):
    """Prefill chunks (causal among a block's tokens and over cached keys) and decode tokens
    in one launch, against the reference; padding tokens past the last get zeros."""
    q_lens, cached, H, KV, D, page_size, splits, bk, pad = case
    q, kp, vp, qs, ctx, table = paged_case(sum(q_lens) + H, q_lens, cached, H, KV, D,
                                           page_size, pad_tokens=pad)
    q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
    out = paged_mgpu.ragged_paged_attention(q, kp, vp, qs, ctx, table, num_splits=splits,
                                            block_k=bk, interpret=True)
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table)
    assert out.shape == q.shape and out.dtype == q.dtype
    live = int(qs[-1])
    assert rel_err(out[:live], ref[:live]) < 1e-2
    assert np.all(np.asarray(out[live:], np.float32) == 0)


def test_ragged_mgpu_lowers_for_hopper():
    T, S, pps = 512 + 63, 64, 520
    q = jax.ShapeDtypeStruct((T, 32, 128), jnp.bfloat16)
    kp = jax.ShapeDtypeStruct((8, S * pps + 3, 16, 128), jnp.bfloat16)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    for splits in (1, 2):
        lowered = paged_mgpu.ragged_paged_attention.trace(
            q, kp, kp, ints(S + 1), ints(S), ints(S, pps), num_splits=splits).lower(
            lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def spy_on_ragged_mosaic(monkeypatch, entry):
    """A Hopper GPU whose tuning names the Mosaic GPU ragged kernel with `entry`; returns the
    keywords of each call the kernel gets (the calls still run, interpreted)."""
    from pallasite import kernels
    from pallasite.kernels import tuning
    called = []
    real = paged_mgpu.ragged_paged_attention
    monkeypatch.setattr(paged_mgpu, "ragged_paged_attention",
                        lambda *a, **kw: called.append(kw) or real(*a, **kw))
    monkeypatch.setattr(kernels, "_is_hopper", lambda: True)
    monkeypatch.setattr(tuning, "ragged_mosaic", lambda: dict(entry))
    return called


def test_ragged_backend_choice(monkeypatch):
    """kernels.ragged_paged_attention runs a mixed step through the Mosaic GPU kernel on a
    Hopper GPU whose tuning names it, where the page table reaches its `min_keys`; narrower
    tables, decode-only steps, options the kernel lacks, batch-invariant mode and float8 pages
    keep Triton."""
    from pallasite import kernels
    from pallasite.kernels import tuning
    called = spy_on_ragged_mosaic(monkeypatch, dict(block_k=64, num_stages=2, num_splits=1,
                                                    min_keys=64))
    # a fresh prompt of two blocks, a decode token, and padding tokens after them
    q, kp, vp, qs, ctx, table = paged_case(3, [20, 1], [0, 40], 4, 1, 64, 16, pad_tokens=3)
    q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table)
    out = kernels.ragged_paged_attention(q, kp, vp, qs, ctx, table, interpret=True)
    assert len(called) == 1 and called[0]["block_k"] == 64
    assert rel_err(out[:21], ref[:21]) < 1e-2 and np.all(np.asarray(out[21:], np.float32) == 0)
    narrow = table[:, :3]  # 48 keys: under min_keys (contexts cut to fit the table)
    kernels.ragged_paged_attention(q, kp, vp, qs, jnp.minimum(ctx, 48), narrow, interpret=True)
    kernels.ragged_paged_attention(q, kp, vp, qs, ctx, table, logit_softcap=30.0,
                                   interpret=True)
    with tuning.batch_invariant(True):
        kernels.ragged_paged_attention(q, kp, vp, qs, ctx, table, interpret=True)
    monkeypatch.setenv("PALLASITE_RAGGED_BACKEND", "triton")
    kernels.ragged_paged_attention(q, kp, vp, qs, ctx, table, interpret=True)
    assert len(called) == 1
    monkeypatch.delenv("PALLASITE_RAGGED_BACKEND")
    fp8 = kp.astype(jnp.float8_e4m3fn)  # V keys-last, which the Mosaic GPU kernel does not read
    assert kernels._ragged_mosaic(q, fp8, table, set(), True) is None
    assert kernels._ragged_mosaic(q, kp, table, set(), True) is not None


PERSISTENT_CASES = [
    # ctx, KV, splits, programs: fewer CTAs than (sequence, kv head) items, each walking every
    # programs-th item through one ring (contexts 0 and 1 among them)
    ([45, 1, 83, 0, 200], 1, 2, 2),   # split-K: the partial tiles reused item to item
    ([130, 0, 37, 64], 2, 1, 3),      # kv heads of one sequence on different CTAs
]


@pytest.mark.parametrize("case", PERSISTENT_CASES)
def test_paged_mgpu_persistent(case):
    """Persistent CTAs (`programs`): each item's output as the reference's, with NaN in every
    stale pool slot; the result equals the one-CTA-an-item kernel's."""
    ctx, KV, splits, programs = case
    q, kp, vp, ctx, table = decode_case(sum(ctx) + KV, ctx, 4 * KV, KV, 64, 16, jnp.bfloat16)
    ref = reference.paged_attention_reference(q, kp, vp, ctx, table)
    t = np.asarray(table)
    kp, vp = poison_stale_slots(kp, ctx, t), poison_stale_slots(vp, ctx, t)
    outs = [paged_mgpu.paged_attention(q, kp, vp, ctx, table, num_splits=splits, block_k=64,
                                       num_stages=2, programs=p, interpret=True)
            for p in (programs, None)]
    assert rel_err(outs[0], ref) < 1e-2
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32),
                                  np.asarray(outs[1], np.float32))


def test_ragged_mgpu_persistent():
    """Mixed steps on persistent CTAs: a chunk's blocks and decode tokens, items of several
    lengths on each CTA, the padding blocks' items without tiles; races checked."""
    q, kp, vp, qs, ctx, table = paged_case(40, [33, 1, 1, 5], [70, 12, 0, 30], 4, 1, 64, 16,
                                           pad_tokens=2)
    q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table)
    out = paged_mgpu.ragged_paged_attention(
        q, kp, vp, qs, ctx, table, block_k=64, programs=3,
        interpret=InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    live = int(qs[-1])
    assert rel_err(out[:live], ref[:live]) < 1e-2
    assert np.all(np.asarray(out[live:], np.float32) == 0)


def test_paged_mgpu_supported():
    q = jnp.zeros((2, 8, 128), jnp.bfloat16)
    kp = jnp.zeros((2, 10, 16, 128), jnp.bfloat16)
    assert paged_mgpu.supported(q, kp) is None
    assert paged_mgpu.supported(q, jnp.zeros((2, 10, 256, 128), jnp.bfloat16)) is None
    why = lambda q, kp, **kw: paged_mgpu.supported(q, kp, **kw) or ""
    assert "dtype" in why(q.astype(jnp.float32), kp.astype(jnp.float32))
    assert "dtype" in why(q, kp.astype(jnp.float16))
    assert "head_dim" in why(q[..., :96], kp[..., :96])
    assert "kv heads" in why(q[:, :6], jnp.zeros((4, 10, 16, 128), jnp.bfloat16))
    assert "group" in why(jnp.zeros((1, 128, 64), jnp.bfloat16), kp[:1, ..., :64])
    assert "page_size" in why(q, jnp.zeros((2, 10, 12, 128), jnp.bfloat16))
    assert "page_size" in why(q, jnp.zeros((2, 10, 48, 128), jnp.bfloat16))
    assert "block_k" in why(q, kp, block_k=32)
    assert "programs" in why(q, kp, programs=0)
    assert "shared memory" in why(q, kp, block_k=128, num_stages=4)
    with pytest.raises(ValueError, match="cannot take this call: head_dim"):
        paged_mgpu.paged_attention(q[..., :32], kp[..., :32], kp[..., :32],
                                   jnp.ones((2,), jnp.int32), jnp.zeros((2, 1), jnp.int32))


def test_paged_mgpu_no_races():
    """The interpreter's race detector over a ring that wraps and a tile crossing the end."""
    q, kp, vp, ctx, table = decode_case(23, [300], 4, 1, 64, 16, jnp.bfloat16)
    out = paged_mgpu.paged_attention(q, kp, vp, ctx, table, num_stages=2,
                                     interpret=InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    assert rel_err(out, reference.paged_attention_reference(q, kp, vp, ctx, table)) < 1e-2


def test_paged_mgpu_refuses_fp8_pages():
    """Float8 V pages are keys-last ([KV, P, D, page_size]); this kernel reads [page_size, D]."""
    q = jnp.zeros((2, 8, 128), jnp.bfloat16)
    k8 = jnp.zeros((2, 10, 16, 128), jnp.float8_e4m3fn)
    v8 = jnp.zeros((2, 10, 128, 16), jnp.float8_e4m3fn)
    assert "float8 pages: V is keys-last" in paged_mgpu.supported(q, k8)
    with pytest.raises(ValueError, match="cannot take this call: float8 pages"):
        paged_mgpu.paged_attention(q, k8, v8, jnp.ones((2,), jnp.int32),
                                   jnp.zeros((2, 1), jnp.int32))


@pytest.mark.parametrize("S,H,KV,D,page_size,kw", [
    (1, 32, 8, 128, 16, dict(num_splits=16)),          # batch 1, long context
    (64, 32, 8, 128, 16, dict(num_stages=3)),          # large batch, one split
    (4, 8, 8, 64, 32, dict(num_splits=2)),             # groups of 1: 8-row outputs
    (4, 8, 1, 64, 128, dict(num_splits=2)),            # pages of two tiles
    (4, 16, 2, 64, 16, dict(block_k=128, num_stages=3)),  # 8 copies a tile
])
def test_paged_mgpu_lowers_for_hopper(S, H, KV, D, page_size, kw):
    pps = 64
    q = jax.ShapeDtypeStruct((S, H, D), jnp.bfloat16)
    kp = jax.ShapeDtypeStruct((KV, S * pps + 3, page_size, D), jnp.bfloat16)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    lowered = paged_mgpu.paged_attention.trace(q, kp, kp, ints(S), ints(S, pps), **kw).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_decode_backend_choice(monkeypatch):
    """kernels.paged_attention runs the decode kernel the tuning table names for this GPU
    (Triton off Hopper and on the H100, Mosaic GPU on the H200 from 8192 keys of table) where
    it takes the call, else Triton (float8 pages always); backend= (or the environment)
    overrides, and an asked-for backend that cannot take the call says why. Through the Mosaic
    path in the interpreter, the result is the reference's."""
    from pallasite import kernels
    from pallasite.kernels import tuning
    q, kp, vp, ctx, table = decode_case(31, [300], 4, 1, 64, 16, jnp.bfloat16)
    f32 = q.astype(jnp.float32), kp.astype(jnp.float32)
    assert kernels.decode_backend(q, kp, table) == "triton"  # no Hopper here
    monkeypatch.setattr(kernels, "_is_hopper", lambda: True)
    wide = jnp.pad(table, ((0, 0), (0, 8192 // 16 - table.shape[1])))  # a table of 8192 keys
    for gpu, want in (("H100", "triton"), ("H200", "mosaic")):
        monkeypatch.setattr(tuning, "gpu_key", lambda gpu=gpu: gpu)
        assert kernels.decode_backend(q, kp, wide) == want
        assert kernels.decode_backend(q, kp, table) == "triton"  # short tables: Triton
        with kernels.portable_backends():  # a program over several GPUs: Triton unless asked
            assert kernels.decode_backend(q, kp, wide) == "triton"
            assert kernels.decode_backend(q, kp, table, backend="mosaic") == "mosaic"
    assert kernels.decode_backend(*f32, table) == "triton"  # Mosaic cannot take float32
    fp8 = kp.astype(jnp.float8_e4m3fn)  # V keys-last: Triton's on every GPU, at any table
    assert kernels.decode_backend(q, fp8, wide) == "triton"
    with pytest.raises(ValueError, match="cannot take float8 pages"):
        kernels.decode_backend(q, fp8, table, backend="mosaic")
    assert kernels.decode_backend(q, kp, table, pages_per_block=2) == "triton"  # Triton's tiles
    assert kernels.decode_backend(q, kp, table, backend="triton") == "triton"
    monkeypatch.setattr(tuning, "gpu_key", lambda: "H100")
    monkeypatch.setenv("PALLASITE_DECODE_BACKEND", "mosaic")
    assert kernels.decode_backend(q, kp, table) == "mosaic"
    with pytest.raises(ValueError, match="Mosaic GPU decode kernel cannot take this call: dtype"):
        kernels.decode_backend(*f32, table)
    with pytest.raises(ValueError, match="not one of"):
        kernels.decode_backend(q, kp, table, backend="cuda")
    out = kernels.paged_attention(q, kp, vp, ctx, table, num_splits=2, interpret=True)
    assert rel_err(out, reference.paged_attention_reference(q, kp, vp, ctx, table)) < 1e-2
