"""Tiny random Hugging Face checkpoints of every supported family, saved with `transformers`."""

from __future__ import annotations

import torch
import transformers

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_mqa_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})),
    "llama_linear_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                          dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32})),
    "qwen3_yarn_mscale": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                          dict(head_dim=32, rope_scaling={
                              "rope_type": "yarn", "factor": 8.0, "mscale": 0.9,
                              "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                              "truncate": False, "original_max_position_embeddings": 16})),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(pad_token_id=0)),
    # Pretrained on 24 positions: the 37-token parity test runs on the long factors.
    "phi3_longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        pad_token_id=0, max_position_embeddings=512, original_max_position_embeddings=24,
        rope_scaling={"rope_type": "longrope", "partial_rotary_factor": 0.5,
                      "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 2.0, 3.0, 5.0]})),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM,
                       dict(sliding_window=8)),
    "qwen2_window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, pad_token_id=0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=32, query_pre_attn_scalar=48, sliding_window=6, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=5.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6}}, pad_token_id=0)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, swiglu_limit=0.3)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=None, num_key_value_heads=4)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=True)),
    "qwen3_moe_unnormed": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                           dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                norm_topk_prob=False)),
}


def build(family: str, seed: int = 0, config: dict | None = None):
    """A float32 torch model of `family` with every weight random (norm scales near one, biases
    non-zero), so that no parameter can be loaded wrong unnoticed. `config` overrides fields."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **extra, **(config or {})}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def save(family: str, folder, seed: int = 0, config: dict | None = None, **save_kwargs):
    model = build(family, seed, config)
    model.save_pretrained(folder, **save_kwargs)
    return model
