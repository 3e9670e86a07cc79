"""Context parallelism: the flash kernel's log-sum-exp, the exact merge of partials, the zig-zag
ring over a "cp" axis of fake CPU devices, and a prompt's prefill split over cp giving the
logits, KV pages and greedy continuation of one device.

The mesh tests run in one child pytest with 8 fake devices (as in test_sharding.py):
`XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_context.py`.
"""

import os
import re
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.kernels.flash_lse import (attention_lse_reference, flash_attention_lse,
                                         merge_partials)
from pallasite.kernels.reference import attention_reference

FAKE_DEVICES = "--xla_force_host_platform_device_count=8"
ON_8_DEVICES = FAKE_DEVICES in os.environ.get("XLA_FLAGS", "")
mesh_test = pytest.mark.skipif(not ON_8_DEVICES, reason="runs in the 8-device child process")
parent_only = pytest.mark.skipif(ON_8_DEVICES, reason="runs in the parent process")

B, H, KV, D = 2, 4, 2, 16


def qkv(T, S=None, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    S = S or T
    return (jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, S, KV, D)),
            jax.random.normal(ks[2], (B, S, KV, D)))


@parent_only
def test_the_mesh_tests_pass_on_8_fake_devices():
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAKE_DEVICES}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-p", "no:randomly", os.path.basename(__file__)], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    report = done.stdout[-8000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert re.search(r"\b\d+ passed, 5 skipped\b", report), report


# -- one device ----------------------------------------------------------------------------------

@parent_only
@pytest.mark.parametrize("causal", [True, False])
def test_flash_lse_kernel_matches_the_reference(causal):
    """Interpret-mode kernel against the jnp reference, with scattered positions and padding
    keys (-1), the layout a zig-zag block has; the reference's lse against logsumexp."""
    T, S = 24, 40
    q, k, v = qkv(T, S)
    rng = np.random.default_rng(0)
    q_pos = jnp.asarray(rng.permutation(S)[:T], jnp.int32)
    k_pos = jnp.asarray(np.where(rng.random(S) < 0.2, -1, rng.permutation(S)), jnp.int32)
    o, lse = flash_attention_lse(q, k, v, q_pos, k_pos, causal=causal, interpret=True,
                                 block_q=16, block_k=16)
    o_ref, lse_ref = attention_lse_reference(q, k, v, q_pos, k_pos, causal=causal)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, atol=2e-5)
    seen = (k_pos[None, :] >= 0) & ((not causal) | (k_pos[None, :] <= q_pos[:, None]))
    s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, H // KV, 2)) * D ** -0.5
    want = jax.nn.logsumexp(jnp.where(seen, s, -jnp.inf), axis=-1)
    np.testing.assert_allclose(jnp.where(seen.any(1), lse_ref, 0), jnp.where(seen.any(1), want, 0),
                               atol=2e-5)


@parent_only
def test_tile_bounds_skip_what_no_query_sees():
    """Contiguous causal positions: query block i visits key tiles [0, i + 1), the causal
    work; a tile of padding is never visited; a zig-zag block (chunks 0 and 3 of 4) visits
    its first chunk from its first query block, everything from its second."""
    from pallasite.kernels.flash_lse import tile_bounds
    pos = jnp.arange(64, dtype=jnp.int32)
    lo, hi = tile_bounds(pos, pos, causal=True, block_q=16, block_k=16)
    assert lo.tolist() == [0, 0, 0, 0] and hi.tolist() == [1, 2, 3, 4]
    k_pos = jnp.where(pos < 48, pos, -1)
    assert tile_bounds(pos, k_pos, causal=False, block_q=16, block_k=16)[1].tolist() == [3] * 4
    zz = jnp.concatenate([jnp.arange(16), 48 + jnp.arange(16)]).astype(jnp.int32)
    lo, hi = tile_bounds(zz, zz, causal=True, block_q=16, block_k=16)
    assert lo.tolist() == [0, 0] and hi.tolist() == [1, 2]


@parent_only
def test_merging_two_partials_equals_attention_over_all_keys():
    """Keys split unevenly in two: the merge is full attention; a row that saw no key on one
    side takes the other side whole."""
    T = S = 19
    q, k, v = qkv(T, S, seed=1)
    pos = jnp.arange(S, dtype=jnp.int32)
    cut = 7
    a = attention_lse_reference(q, k[:, :cut], v[:, :cut], pos, pos[:cut])
    b = attention_lse_reference(q, k[:, cut:], v[:, cut:], pos, pos[cut:])
    o, _ = merge_partials(*a, *b)
    np.testing.assert_allclose(o, attention_reference(q, k, v, causal=True), atol=2e-6)
    # rows 0..6 saw nothing in b: their lse there is NEG_INF and the merge keeps a
    np.testing.assert_allclose(o[:, :cut], a[0][:, :cut], atol=1e-7)


# -- the ring on a cp mesh -----------------------------------------------------------------------

def run_ring(q, k, v, n, causal, interpret):
    from jax.sharding import Mesh, PartitionSpec as P
    from pallasite.sharding.context import shard_map
    from pallasite.sharding.ring import ring_attention, zigzag_order
    L = q.shape[1]
    size = -(-L // (2 * n)) * 2 * n
    order = zigzag_order(size, n)
    lay = lambda x: jnp.pad(x, ((0, 0), (0, size - L), (0, 0), (0, 0)))[:, order]
    attend = partial(flash_attention_lse, interpret=interpret, block_q=16, block_k=16)
    ring = partial(ring_attention, axis="cp", n=n, causal=causal, kv_len=L, attend=attend)
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    fn = shard_map(ring, mesh=mesh, in_specs=(P(None, "cp"),) * 3,
                   out_specs=(P(None, "cp"), P(None, None, "cp")), check_vma=False)
    o, _ = jax.jit(fn)(lay(q), lay(k), lay(v))
    return jnp.zeros_like(o).at[:, order].set(o)[:, :L]


@mesh_test
@pytest.mark.parametrize("n,causal,interpret", [(2, True, True), (4, False, False),
                                                (8, True, False)])
def test_ring_equals_full_attention(n, causal, interpret):
    """37 tokens (not a multiple of 2 x cp: padded keys must be invisible), GQA; the Pallas
    kernel in interpret mode on one case (it is slow there), the jnp reference on the others."""
    q, k, v = qkv(37, seed=n)
    o = run_ring(q, k, v, n, causal, interpret)
    np.testing.assert_allclose(o, attention_reference(q, k, v, causal=causal), atol=2e-5)


@mesh_test
def test_zigzag_gives_every_device_the_same_causal_work():
    from pallasite.sharding.ring import zigzag_order
    n, size = 4, 64
    order = zigzag_order(size, n).reshape(n, -1)
    assert sorted(order.ravel().tolist()) == list(range(size))
    pairs = [int(sum(p + 1 for p in block)) for block in order]  # keys seen under the mask
    assert len(set(pairs)) == 1, pairs
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        zigzag_order(30, 4)


# -- prefill over cp in the model ----------------------------------------------------------------

PAGE_SIZE, NUM_PAGES = 4, 40


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_sharding import dense_model
    return dense_model()


def one_device_step(config):
    from pallasite.model import forward
    return jax.jit(lambda p, t, q, kv, b: forward(p, config, t, q, kv, b))


def one_device_prefill(step, params, kv, tokens, table, cached=0):
    from pallasite.model import Batch
    L = len(tokens)
    pos = (cached + np.arange(L)).astype(np.int32)
    batch = Batch(*map(jnp.asarray, (np.array([0, L], np.int32), np.array([cached + L], np.int32),
                                     table[None], table[pos // PAGE_SIZE] * PAGE_SIZE
                                     + pos % PAGE_SIZE, np.array([L - 1], np.int32))))
    return step(params, np.asarray(tokens, np.int32), pos, kv, batch)


def greedy(step, params, kv, logits, prompt_len, table, n=5):
    """n greedy tokens decoded on one device from a prefilled cache."""
    out = []
    for i in range(n):
        out.append(int(np.argmax(np.asarray(logits)[0])))
        logits, kv = one_device_prefill(step, params, kv, [out[-1]], table, prompt_len + i)
    return out


@mesh_test
@pytest.mark.parametrize("n", [4])
def test_cp_prefill_equals_one_device(model, n):
    """A 29-token prompt (not a multiple of 2 x cp) prefilled over cp, then again with its
    first 13 tokens already in the pages (a prefix-cache hit, cut mid-page): the last token's
    logits, every KV page, and the greedy continuation decoded from the pages are one
    device's."""
    from pallasite.model import init_kv_cache
    from pallasite.sharding.context import ContextParallel, cp_mesh
    config, params = model
    rng = np.random.default_rng(n)
    prompt = rng.integers(0, config.vocab_size, 29).astype(np.int32)
    table = rng.permutation(np.arange(1, NUM_PAGES))[:10].astype(np.int32)
    step = one_device_step(config)
    fresh = lambda: init_kv_cache(config, NUM_PAGES, PAGE_SIZE, jnp.float32)
    ref, kv_ref = one_device_prefill(step, params, fresh(), prompt, table)
    want = greedy(step, params, kv_ref, ref, len(prompt), table)
    cp = ContextParallel(config, cp_mesh(n), PAGE_SIZE)
    _, kv_prefix = one_device_prefill(step, params, fresh(), prompt[:13], table)
    for cached, kv in ((0, fresh()), (13, kv_prefix)):
        logits, kv = cp.prefill(cp.place(params), cp.place(kv), prompt[cached:], table, cached)
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
        for (k, v), (k_ref, v_ref) in zip(kv, kv_ref):
            np.testing.assert_allclose(k, k_ref, atol=1e-5)
            np.testing.assert_allclose(v, v_ref, atol=1e-5)
        kv = jax.device_put(jax.tree.map(np.asarray, kv))
        assert greedy(step, params, kv, logits, len(prompt), table) == want


def small_model(**fields):
    from pallasite.model import config_from_dict, init_params
    config = config_from_dict(dict(vocab_size=256, hidden_size=96, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   **fields))
    return config, jax.jit(lambda: jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x + 0.1,
                                                init_params(config, seed=5)))()


@mesh_test
def test_cp_prefill_takes_the_models_scale_and_head_dim():
    """Gemma 3's heads as the ring must take them: head dim 24 (pages 32 wide, zeros after the
    head) and a score scale from query_pre_attn_scalar, not from the head dim. The prompt's
    logits and pages over cp are one device's."""
    from pallasite.model import init_kv_cache
    from pallasite.sharding.context import ContextParallel, cp_mesh
    config, params = small_model(model_type="gemma3_text", head_dim=24,
                                 query_pre_attn_scalar=40,
                                 layer_types=["full_attention", "full_attention"])
    assert config.page_head_dim == 32 and config.sm_scale != 24 ** -0.5
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, 21).astype(np.int32)
    table = rng.permutation(np.arange(1, NUM_PAGES))[:8].astype(np.int32)
    kv = init_kv_cache(config, NUM_PAGES, PAGE_SIZE, jnp.float32)
    ref, kv_ref = one_device_prefill(one_device_step(config), params, kv, prompt, table)
    cp = ContextParallel(config, cp_mesh(2), PAGE_SIZE)
    logits, kv = cp.prefill(cp.place(params), cp.place(kv), prompt, table)
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    for (k, v), (k_ref, v_ref) in zip(kv, kv_ref):
        np.testing.assert_allclose(k, k_ref, atol=1e-5)
        np.testing.assert_allclose(v, v_ref, atol=1e-5)


@mesh_test
def test_cp_prefill_refuses_a_window():
    """A sliding window is not in the ring's attention: a clear error, not other logits."""
    from pallasite.model import init_kv_cache
    from pallasite.sharding.context import ContextParallel, cp_mesh
    config, params = small_model(model_type="mistral", sliding_window=8)
    kv = init_kv_cache(config, NUM_PAGES, PAGE_SIZE, jnp.float32)
    cp = ContextParallel(config, cp_mesh(2), PAGE_SIZE)
    with pytest.raises(ValueError, match="sliding_window"):
        cp.prefill(cp.place(params), cp.place(kv), np.arange(12, dtype=np.int32),
                   np.arange(1, 5, dtype=np.int32))
