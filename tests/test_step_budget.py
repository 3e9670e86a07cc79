"""The step time budget's arithmetic on shapes worked out by hand."""

import pytest

from benchmarks import step_budget as sb
from pallasite.model import config_from_dict

TINY = config_from_dict(dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=4, max_position_embeddings=64))


def test_tiny_model_costs():
    cost = sb.model_cost(TINY, itemsize=2)
    # wq, wo: 8*2*4 each; wk, wv: 8*1*4 each; MLP 3*8*16
    assert cost.body_params == 64 + 64 + 32 + 32 + 384
    assert cost.head_params == 80
    assert cost.weight_bytes == 2 * (576 + 80 + 3 * 8)
    assert cost.kv_bytes_per_token == 2 * 1 * 1 * 4 * 2
    assert cost.attn_flops_per_pair == 4 * 2 * 4


def test_8bit_weights_read_half_and_run_twice_as_fast():
    bf16, fp8 = sb.model_cost(TINY, itemsize=2), sb.model_cost(TINY, 2, 1, *sb.QUANTIZED_BODY["fp8"])
    assert fp8.weight_bytes == bf16.weight_bytes - 576  # the body: one byte a weight
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token // 2
    # the body's FLOPs at twice the peak; the head and attention at the bf16 peak
    assert sb.step_flops(fp8, 3, 18, 3) == 576 * 3 + 2 * 80 * 3 + 32 * 18


def test_decode_and_mixed_steps():
    cost = sb.model_cost(TINY, itemsize=2)
    # Decode: 3 rows at contexts 5, 6, 7 (each query sees its whole context).
    decode = dict(tokens=3, context_tokens=18, attended_tokens=18, sampled_rows=3)
    assert sb.step_flops(cost, 3, 18, 3) == 2 * 576 * 3 + 2 * 80 * 3 + 32 * 18
    assert sb.step_bytes(cost, 3, 18) == cost.weight_bytes + 16 * (18 + 3)
    b = sb.budget(cost, decode, bandwidth=1e3, peak=1e6)
    assert b["memory_s"] == pytest.approx(sb.step_bytes(cost, 3, 18) / 1e3)
    assert b["roofline_s"] == max(b["memory_s"], b["compute_s"]) == b["memory_s"]
    # A prefill chunk of 4 tokens from position 2: queries see 3, 4, 5, 6 keys.
    assert sb.attended_pairs(2, 4) == 3 + 4 + 5 + 6
    mixed = dict(tokens=3 + 4, context_tokens=18 + 6, attended_tokens=18 + 18, sampled_rows=3)
    b = sb.budget(cost, mixed, bandwidth=1e12, peak=1.0)
    assert b["roofline_s"] == b["compute_s"] == 2 * 576 * 7 + 2 * 80 * 3 + 32 * 36


def test_llama3_8b_decode_step_on_an_h100():
    config = config_from_dict(dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8))
    cost = sb.model_cost(config)
    assert cost.weight_bytes / 1e9 == pytest.approx(15.01, abs=0.01)  # all but the embedding
    assert cost.kv_bytes_per_token == 131072
    peak = sb.peak_bf16("NVIDIA H100 80GB HBM3")
    assert peak == 989.4e12 and sb.peak_bf16("some CPU") is None
    # 256 rows at context 512: memory-bound at 3 TB/s (weights 5.0 ms + K/V 5.7 ms).
    entry = dict(tokens=256, context_tokens=256 * 512, attended_tokens=256 * 512, sampled_rows=256)
    b = sb.budget(cost, entry, 3.0e12, peak)
    assert b["memory_s"] * 1e3 == pytest.approx(10.74, abs=0.01)
    assert b["compute_s"] * 1e3 == pytest.approx(3.95, abs=0.01)


def test_the_engine_logs_what_the_budget_needs():
    import numpy as np
    from pallasite.serving.batch import BatchState, Packed
    packed = Packed(key=(16, 4), n=3, stats=(np.array([4, 5, 2]), np.array([1, 1, 4]),
                                              np.array([True, True, False])))
    entry = BatchState.describe(packed)
    assert entry == dict(T=16, P=4, rows=3, tokens=6, decode_rows=2, sampled_rows=2,
                         context_tokens=5 + 6 + 6, decode_context=11,
                         attended_tokens=5 + 6 + (3 + 4 + 5 + 6))
