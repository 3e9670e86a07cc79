"""Quantized weights (`model.quant`): the layout, FP8 quantization against numpy, the model's
projections on QArrays against the dequantized weights, and quantize-on-load."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallasite.model import config_from_dict, forward_logits, init_params, load_hf, quant

import hf_models


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def dequantized(params):
    return jax.tree.map(quant.dequantize, params, is_leaf=quant.is_quantized)


def test_fp8_per_channel_matches_numpy():
    w = np.random.default_rng(0).normal(size=(64, 4, 16)).astype(np.float32)  # like wq
    w[:, 1, 3] = 0  # an all-zero output channel keeps scale 1
    qa = quant.quantize_fp8(w, contract_axes=(0,))
    assert qa.q.dtype == jnp.float8_e4m3fn and qa.scale.dtype == jnp.float32
    assert qa.scale.shape == (1, 4, 16) and qa.block == (64, 1, 1)
    scale = np.abs(w).max(0, keepdims=True) / 448
    scale[scale == 0] = 1
    np.testing.assert_allclose(qa.scale, scale, rtol=1e-6)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(qa.q).view(np.uint8), q.view(np.uint8))
    back = quant.numpy_dequantize(np.asarray(qa.q), np.asarray(qa.scale), qa.block)
    np.testing.assert_allclose(quant.dequantize(qa), back)
    assert rel_err(back, w) < 0.04  # e4m3 keeps 3 mantissa bits


def test_blocks_and_matrix_view():
    w = np.random.default_rng(1).normal(size=(256, 2, 128)).astype(np.float32)
    qa = quant.quantize_fp8(w, block=(128, 1, 128))  # DeepSeek-style 128x128 blocks
    assert qa.scale.shape == (2, 2, 1)
    m = quant.matrix(qa, in_axes=1)
    assert m.q.shape == (256, 256) and m.block == (128, 128) and m.scale.shape == (2, 2)
    np.testing.assert_array_equal(quant.dequantize(m), quant.dequantize(qa).reshape(256, 256))
    wo = quant.quantize_fp8(w.reshape(2, 128, 256), contract_axes=(0, 1))  # like wo
    m = quant.matrix(wo, in_axes=2)
    assert m.block == (256, 1) and m.scale.shape == (1, 256)
    with pytest.raises(ValueError, match="flatten"):
        quant.matrix(quant.quantize_fp8(w, block=(1, 2, 64)), in_axes=1)
    with pytest.raises(ValueError, match="wq: scale has shape"):
        quant.check(quant.QArray(qa.q, jnp.ones((3, 2, 1)), None, "fp8"), "wq")


@pytest.fixture(scope="module")
def tiny():
    config = config_from_dict(dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False))
    params = init_params(config, seed=2)
    return config, params


def test_quantized_model_equals_its_dequantized_weights(tiny):
    config, params = tiny
    qp = quant.quantize_params(params)
    layer = qp["layers_0"]
    assert quant.is_quantized(layer["attn"]["wo"]) and quant.is_quantized(layer["moe"]["w_down"])
    assert not quant.is_quantized(layer["moe"]["router"]) and qp["embed"].dtype == jnp.float32
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    got = forward_logits(qp, config, ids)
    want = forward_logits(dequantized(qp), config, ids)
    assert rel_err(got, want) <= 1e-5
    assert quant.weight_bytes(qp) < 0.45 * quant.weight_bytes(params)


def test_quantize_on_load(tmp_path):
    hf_models.save("llama", tmp_path)
    config, plain = load_hf(tmp_path, dtype=jnp.float32)
    _, qp = load_hf(tmp_path, dtype=jnp.float32, quantization="fp8")
    wq = qp["layers_1"]["attn"]["wq"]
    assert wq.q.dtype == jnp.float8_e4m3fn and wq.logical(wq.scale).shape == (1,) + wq.shape[1:]
    assert wq.q.shape == wq.shape[1:] + wq.shape[:1]  # stored [out..., in]: the kernels' [N, K]
    assert qp["lm_head"].dtype == jnp.float32 and qp["embed"].dtype == jnp.float32
    want = jax.tree.map(lambda w: quant.quantize_fp8(w, (0,)) if w.ndim == 2 else w,
                        plain["layers_1"]["mlp"])
    for name in ("w_gate", "w_up", "w_down"):
        got = qp["layers_1"]["mlp"][name]
        np.testing.assert_array_equal(np.asarray(got.logical(got.q), np.float32),
                                      np.asarray(want[name].q, np.float32))
    with pytest.raises(ValueError, match="'int3' is not one of fp8"):
        load_hf(tmp_path, quantization="int3")


def test_llm_with_fp8_weights_generates_what_its_weights_say(tmp_path):
    from pallasite.serving.llm import LLM, SamplingParams
    hf_models.save("qwen3", tmp_path)
    with LLM(tmp_path, quantization="fp8", max_model_len=64, num_pages=32, page_size=8,
             max_num_seqs=2, max_num_batched_tokens=16, token_buckets=[1, 16],
             page_buckets=[8], warmup=False) as llm:  # compiles only the greedy steps' programs
        params = llm.engine.params
        # one device: gate/up fused into one FP8 weight; a lone decode row is not padded
        assert quant.is_quantized(params["layers_0"]["mlp"]["w_gate_up"])
        assert llm.engine.token_buckets == [1, 16]
        prompt = [5, 17, 33, 2, 9]
        out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0,
                                                    ignore_eos=True))[0]
        ids = list(prompt)
        ref = jax.jit(lambda p, x: forward_logits(p, llm.config, x))
        for _ in range(5):
            padded = np.zeros((1, 16), np.int32)
            padded[0, :len(ids)] = ids
            ids.append(int(np.argmax(ref(params, padded)[0, len(ids) - 1])))
        assert list(out.token_ids) == ids[len(prompt):]


def test_unknown_quantization_is_refused_with_the_choices(capsys):
    from pallasite.cli import build_parser
    from pallasite.serving.llm import LLM
    with pytest.raises(ValueError, match="'fp4' is not one of fp8"):
        LLM("/nonexistent", quantization="fp4")  # refused before anything is read
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--quantization", "fp4"])
        assert "invalid choice: 'fp4' (choose from" in capsys.readouterr().err
