"""Fused q/k/v and gate/up weights (`model/fuse.py`): the model reads them and computes what
the separate weights compute, for every weight kind, and parts that do not line up stay apart."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.model import config_from_dict, forward_logits, init_params, quant, quant_int
from pallasite.model.fuse import GATE_UP, QKV, fuse_params


@pytest.fixture(scope="module")
def dense():
    config = config_from_dict(dict(
        model_type="qwen2", vocab_size=128, hidden_size=256, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128))
    params = init_params(config, seed=3)
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    return config, params, ids


def copy(params):
    return jax.tree.map(lambda a: a, params, is_leaf=lambda a: hasattr(a, "words"))


def fp8_blocks(params, block):
    """FP8 with the given scale blocks on [d, h, hd] / [d, f] weights, stored [N, K]."""
    def one(path, w):
        keys = tuple(getattr(k, "key", k) for k in path)
        axes = quant.linear_axes(keys)
        if axes is None or axes[0]:
            return w
        if axes[1] != 1:  # wo: per output channel
            return quant.quantize_linear(w, axes)
        return quant.to_k_last(quant.quantize_fp8(w, block=block(w.shape)), 1)
    return jax.tree_util.tree_map_with_path(one, params)


KINDS = {
    "plain": lambda p: p,
    "fp8": lambda p: quant_int.quantize_params(p, "fp8"),
    # DeepSeek-style 128 x 128 blocks over K and the outputs' last axis
    "fp8_blocks": lambda p: fp8_blocks(p, lambda s: (128,) + (1,) * (len(s) - 2) + (
        min(128, s[-1]),)),
    "fp8_tensor": lambda p: fp8_blocks(p, lambda s: s),  # one scale a weight
    "w4a16": lambda p: quant_int.quantize_params(p, "w4a16"),
    "w8a16": lambda p: quant_int.quantize_params(p, "w8a16"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_fused_weights_compute_what_the_parts_do(dense, kind):
    config, params, ids = dense
    apart = KINDS[kind](params)
    want = forward_logits(apart, config, ids)
    fused = fuse_params(copy(apart))
    attn, mlp = fused["layers_1"]["attn"], fused["layers_1"]["mlp"]
    assert set(attn) == {QKV, "wo", "bq", "bk", "bv"} and set(mlp) == {GATE_UP, "w_down"}
    assert attn[QKV].shape == (256, 2, 4, 64) and mlp[GATE_UP].shape == (256, 2, 384)
    assert type(attn[QKV]) is type(apart["layers_1"]["attn"]["wq"])
    if kind != "plain":  # the fused weight keeps the parts' stored bytes, no wider
        assert quant.weight_bytes(fused) <= 1.3 * quant.weight_bytes(apart)
    got = forward_logits(fused, config, ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fused_fp8_dequantizes_to_the_parts(dense):
    config, params, _ = dense
    apart = KINDS["fp8_blocks"](params)["layers_0"]["attn"]
    w = fuse_params({"layers_0": {"attn": dict(apart)}})["layers_0"]["attn"][QKV]
    full = np.asarray(quant.dequantize(w))  # [d, kv, g + 2, hd]
    q = np.asarray(quant.dequantize(apart["wq"])).reshape(256, 2, 2, 64)
    np.testing.assert_array_equal(full[:, :, :2], q)
    np.testing.assert_array_equal(full[:, :, 2], np.asarray(quant.dequantize(apart["wk"])))
    np.testing.assert_array_equal(full[:, :, 3], np.asarray(quant.dequantize(apart["wv"])))


def test_parts_that_do_not_line_up_stay_apart(dense):
    config, params, ids = dense
    packed = quant_int.quantize_params(params, "w4a16")
    attn = packed["layers_0"]["attn"]
    perm = lambda seed: jnp.asarray(np.random.default_rng(seed).permutation(256), jnp.int32)
    # act order: differing permutations cannot share one activation gather
    attn["wq"] = dataclasses.replace(attn["wq"], perm=perm(1))
    attn["wk"] = dataclasses.replace(attn["wk"], perm=perm(2))
    attn["wv"] = dataclasses.replace(attn["wv"], perm=perm(1))
    mlp = packed["layers_1"]["mlp"]
    same = perm(3)
    mlp["w_gate"], mlp["w_up"] = (dataclasses.replace(mlp[n], perm=same)
                                  for n in ("w_gate", "w_up"))
    packed["layers_1"]["attn"]["wk"] = params["layers_1"]["attn"]["wk"]  # mixed kinds
    want = forward_logits(packed, config, ids)
    fused = fuse_params(copy(packed))
    assert {"wq", "wk", "wv"} <= fused["layers_0"]["attn"].keys()
    assert {"wq", "wk", "wv"} <= fused["layers_1"]["attn"].keys()
    assert GATE_UP in fused["layers_1"]["mlp"] and GATE_UP in fused["layers_0"]["mlp"]
    np.testing.assert_allclose(forward_logits(fused, config, ids), want, rtol=1e-5, atol=1e-5)


def test_moe_and_mla_layers_pass_through():
    moe = config_from_dict(dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        max_position_embeddings=64))
    params = init_params(moe, seed=0)
    fused = fuse_params(copy(params))
    assert set(fused["layers_0"]["moe"]) == set(params["layers_0"]["moe"])
    assert QKV in fused["layers_0"]["attn"]  # its attention is ordinary
    ids = np.arange(10)[None] % 64
    np.testing.assert_allclose(forward_logits(fused, moe, ids), forward_logits(params, moe, ids),
                               rtol=1e-5, atol=1e-5)


def test_a_fused_weight_of_the_wrong_shape_is_named(dense):
    config, params, ids = dense
    fused = fuse_params(copy(params))
    fused["layers_0"]["attn"][QKV] = fused["layers_0"]["attn"][QKV][:, :, :3]
    with pytest.raises(ValueError, match="param wqkv of attn: shape"):
        forward_logits(fused, config, ids)


def test_a_lone_row_is_padded_only_for_xlas_own_products(dense):
    from pallasite.serving.engine import min_token_bucket
    config, params, _ = dense
    assert min_token_bucket(params) == 2  # XLA's bf16 single-row product is slow
    for mode in ("fp8", "w4a16"):
        q = fuse_params(quant_int.quantize_params(params, mode))
        assert min_token_bucket(q) == 1  # every projection is our kernel
        q["layers_1"]["mlp"]["w_down"] = params["layers_1"]["mlp"]["w_down"]
        assert min_token_bucket(q) == 2
