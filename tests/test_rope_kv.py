"""The fused projection's epilogue (`kernels/rope_kv.py`): RoPE on queries and key plus the page
write in one launch, against the jnp reference and against RoPE as the model applies it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import reference, rope_kv
from pallasite.model.config import RopeScaling
from pallasite.model.layers import apply_rope, rope_frequencies, rope_tables


def _case(T, KV, G, D, page_size, pages, pad, seed, page_dtype=jnp.bfloat16, keys_last=False,
          rot=None, width=None):
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.standard_normal((T, KV, G + 2, D)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 4000, T), jnp.int32)
    cos, sin = rope_tables(positions, rope_frequencies(rot or D, 500000.0, RopeScaling()))
    W = width or D  # the pages' last dim
    v_shape = (KV, pages, W, page_size) if keys_last else (KV, pages, page_size, W)
    kp = jnp.asarray(rng.standard_normal((KV, pages, page_size, W)), jnp.float32).astype(page_dtype)
    vp = jnp.asarray(rng.standard_normal(v_shape), jnp.float32).astype(page_dtype)
    slots = np.asarray(rng.permutation(pages * page_size)[:T], np.int32)
    slots[pad] = -1
    return y, kp, vp, jnp.asarray(slots), cos, sin, positions


@pytest.mark.parametrize("T,KV,G,tokens,pad,bias", [
    (1, 2, 4, 1, [], False), (13, 2, 3, 4, [0, 12], False), (6, 3, 1, 2, [2], False),
    (7, 3, 5, 4, [1], True)])
def test_rope_write_kv_matches_reference(T, KV, G, tokens, pad, bias):
    """Interpret mode against the reference, bit for bit: kv heads and groups that are not
    powers of two (padded and masked), several tokens a program with the last one partial,
    padding tokens writing nothing, and a q/k/v bias (Qwen2, GPT-OSS) added first."""
    y, kp, vp, slots, cos, sin, _ = _case(T, KV, G, 32, 8, 5, pad, seed=T + G)
    kw = {}
    if bias:
        rng = np.random.default_rng(0)
        kw["bias"] = tuple(jnp.asarray(rng.standard_normal((n, 32)), jnp.bfloat16)
                           for n in (KV * G, KV, KV))  # bq, bk, bv
    out = kernels.rope_write_kv(y, kp, vp, slots, cos, sin, interpret=True, tokens=tokens, **kw)
    ref = reference.rope_write_kv_reference(y, kp, vp, slots, cos, sin, **kw)
    assert out[0].shape == (T, KV * G, 32)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
    written = np.asarray(out[0 + 1] != kp).any(axis=(0, 3)).sum()
    assert written == T - len(pad)


@pytest.mark.parametrize("D,rot,norm,plus_one,width", [
    (32, 32, True, False, 32), (32, 32, True, True, 32), (32, 16, False, False, 32),
    (24, 24, False, False, 32), (48, 20, True, False, 64)])
def test_rope_write_kv_norms_and_head_dims(D, rot, norm, plus_one, width):
    """q/k RMSNorms (Qwen3; Gemma's plus-one weights) before RoPE, a rotary over the leading
    `rot` columns with the rest passed over (Phi-3), and head dims whose halves are not powers
    of two (padded lanes, masked) in pages of the next power of two (zeros after the head),
    against the reference, which is the model's norm and RoPE."""
    T, KV, G = 5, 2, 3
    y, kp, vp, slots, cos, sin, _ = _case(T, KV, G, D, 4, 6, [3], seed=D + rot, rot=rot,
                                          width=width)
    kw = {}
    if norm:
        rng = np.random.default_rng(D)
        kw = dict(norm=tuple(jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16)
                             for _ in range(2)), eps=1e-6, plus_one=plus_one)
    out = kernels.rope_write_kv(y, kp, vp, slots, cos, sin, interpret=True, tokens=2, **kw)
    ref = reference.rope_write_kv_reference(y, kp, vp, slots, cos, sin, **kw)
    for o, r in zip(out, ref):  # the norm's mean is summed in another order: within an ulp
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(r, np.float32),
                                   rtol=2 ** -7 if norm else 0, atol=0)
    if rot < D and not norm:  # the columns past the rotary come through as they were made
        q = np.asarray(out[0], np.float32).reshape(T, KV, G, D)
        np.testing.assert_array_equal(q[..., rot:], np.asarray(y, np.float32)[:, :, :G, rot:])


def test_reference_is_the_models_rope():
    """The epilogue's queries and keys are RoPE as the model applies it (`apply_rope`), bit for
    bit, so the serving path keeps its logits."""
    T, KV, G, D = 7, 2, 4, 64
    y, kp, vp, slots, cos, sin, positions = _case(T, KV, G, D, 8, 4, [], seed=5)
    inv_freq = rope_frequencies(D, 500000.0, RopeScaling())
    q, k_pages, _ = reference.rope_write_kv_reference(y, kp, vp, slots, cos, sin)
    q_model = apply_rope(y[:, :, :G].reshape(T, KV * G, D), positions, inv_freq)
    k_model = apply_rope(y[:, :, G], positions, inv_freq)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_model, np.float32))
    s = np.asarray(slots)
    got = np.asarray(k_pages, np.float32)[:, s // 8, s % 8]  # [KV, T, D]
    np.testing.assert_array_equal(got, np.asarray(jnp.swapaxes(k_model, 0, 1), np.float32))


@pytest.mark.parametrize("D,width", [(32, 32), (24, 32)])
def test_rope_write_kv_float8_pages(D, width):
    """Float8 pages: K and V divided by their head's scale and saturated, V keys-last, as the
    reference stores them; in pages wider than the head, zeros after it."""
    y, kp, vp, slots, cos, sin, _ = _case(9, 2, 4, D, 8, 4, [3], seed=2,
                                          page_dtype=jnp.float8_e4m3fn, keys_last=True,
                                          width=width)
    y = y.at[0, 1, 4, 0].set(3e4)  # the key of token 0, head 1: saturates
    scales = dict(k_scale=jnp.asarray([0.5, 2.0]), v_scale=jnp.asarray([0.01, 0.1]))
    out = kernels.rope_write_kv(y, kp, vp, slots, cos, sin, interpret=True, tokens=2, **scales)
    ref = reference.rope_write_kv_reference(y, kp, vp, slots, cos, sin, **scales)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
    assert np.abs(np.asarray(out[1], np.float32)).max() == 448.0


def test_rope_write_kv_lowers_for_gpu():
    """The Triton lowering, pages aliased to the outputs, without a GPU: bf16 and float8
    pages, with and without a bias; a head dim whose halves are not powers of two, a partial
    rotary and q/k norms."""
    sds = jax.ShapeDtypeStruct
    y, cs = sds((5, 8, 6, 128), jnp.bfloat16), sds((5, 64), jnp.float32)
    for dtype, v_shape in ((jnp.bfloat16, (8, 64, 16, 128)), (jnp.float8_e4m3fn, (8, 64, 128, 16))):
        pages = sds((8, 64, 16, 128), dtype)
        scale = {} if dtype == jnp.bfloat16 else dict(k_scale=sds((8,), jnp.float32),
                                                      v_scale=sds((8,), jnp.float32))
        bias = tuple(sds((n, 128), jnp.bfloat16) for n in (32, 8, 8))
        for bias in ({}, dict(bias=bias)):
            text = rope_kv.rope_write_kv.trace(
                y, pages, sds(v_shape, dtype), sds((5,), jnp.int32), cs, cs, tokens=4, **scale,
                **bias).lower(lowering_platforms=("cuda",)).as_text()
            assert "pallasite_rope_write_kv" in text
    # head dim 96 (Phi-3-mini: halves of 48 lanes) in pages 128 wide, a partial rotary, norms
    y, cs = sds((5, 8, 6, 96), jnp.bfloat16), sds((5, 16), jnp.float32)
    pages = sds((8, 64, 16, 128), jnp.bfloat16)
    norm = tuple(sds((96,), jnp.bfloat16) for _ in range(2))
    text = rope_kv.rope_write_kv.trace(y, pages, pages, sds((5,), jnp.int32), cs, cs, norm=norm,
                                       tokens=4).lower(lowering_platforms=("cuda",)).as_text()
    assert "pallasite_rope_write_kv" in text


# families whose fused paged step takes the epilogue: biases (Qwen2, GPT-OSS), q/k norms (Qwen3,
# Gemma 3's plus-one), YaRN's attention factor, a partial rotary (this Phi-3), sinks and windows
EPILOGUE = ("llama", "qwen2", "gpt_oss", "llama_yarn", "qwen3", "gemma3", "phi3_longrope")
def _paged_steps_match(params, config, dense, seq, rng, kv_dtype=jnp.float32):
    """A chunked prefill, then decode steps, each row's logits against the dense forward's."""
    from test_model import paged_step, rel_err

    from pallasite.model import init_kv_cache
    page_size, table = 4, [rng.permutation(16)]
    kv = init_kv_cache(config, 16, page_size, kv_dtype)
    for a, b in ((0, 9), (9, 12), (12, 13), (13, 14)):
        logits, kv = paged_step(params, config, kv, [(0, seq[a:b], a)], table, page_size)
        assert rel_err(np.asarray(logits)[0], dense[b - 1]) <= 1e-4, (a, b)
    return kv


@pytest.mark.parametrize("family", EPILOGUE)
def test_paged_steps_take_the_epilogue(family, tmp_path, monkeypatch):
    """A model with its q/k/v fused (as serving holds it) runs a paged step's RoPE and page
    write through `kernels.rope_write_kv`, here the kernel in interpret mode, and gives the
    logits of the unfused model's dense forward: a chunked prefill, then decode steps. Qwen2
    and GPT-OSS add their q/k/v bias in it, Qwen3 and Gemma 3 their q/k norms, YaRN's tables
    carry its attention factor, and Phi-3's rotate half of each head."""
    import hf_models
    from test_model import dense_logits

    from pallasite.model import load_hf
    from pallasite.model.fuse import fuse_params
    hf_models.save(family, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    assert config.qkv_bias == (family in ("qwen2", "gpt_oss"))
    assert config.qk_norm == (family in ("qwen3", "gemma3"))
    rng = np.random.default_rng(1)
    seq = rng.integers(0, config.vocab_size, 14)
    dense = np.asarray(dense_logits(params, config, seq[None]))[0]
    calls, real = [], kernels.rope_write_kv
    monkeypatch.setattr(kernels, "rope_write_kv",
                        lambda *a, **k: calls.append(1) or real(*a, interpret=True, **k))
    _paged_steps_match(fuse_params(jax.tree.map(lambda a: a, params)), config, dense, seq, rng)
    assert len(calls) == 4 * config.num_layers


@pytest.mark.parametrize("way", ["kernel", "reference", "apart"])
def test_head_dim_off_a_power_of_two(way, tmp_path, monkeypatch):
    """Phi-3-mini's head dim 96 (here 24), which the attention kernels do not tile: pages of
    the next power of two (`page_head_dim`), queries and keys padded with zeros and scored at
    the head dim's scale. The dense forward gives transformers' logits; the paged steps, with
    the epilogue kernel (interpret mode), its jnp reference or the projections apart, the
    dense forward's; the pages' padding stays zero."""
    import hf_models
    from test_model import dense_logits, rel_err, torch_logits

    from pallasite.model import load_hf
    from pallasite.model.fuse import fuse_params
    model = hf_models.save("phi3", tmp_path, config=dict(hidden_size=96))
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    assert (config.head_dim, config.page_head_dim) == (24, 32)
    rng = np.random.default_rng(2)
    seq = rng.integers(0, config.vocab_size, 14)
    dense = np.asarray(dense_logits(params, config, seq[None]))[0]
    assert rel_err(dense, torch_logits(model, seq[None])[0]) <= 1e-4
    real = kernels.rope_write_kv
    if way == "kernel":
        monkeypatch.setattr(kernels, "rope_write_kv",
                            lambda *a, **k: real(*a, interpret=True, **k))
    if way != "apart":
        params = fuse_params(jax.tree.map(lambda a: a, params))
    kv = _paged_steps_match(params, config, dense, seq, rng)
    assert kv[0][0].shape[-1] == 32 and not np.asarray(kv[0][0])[..., 24:].any()
