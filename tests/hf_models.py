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


def build(family: str, seed: int = 0):
    """A float32 torch model of `family` with every weight random (norm scales near one, biases
    non-zero), so that no parameter can be loaded wrong unnoticed."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def save(family: str, folder, seed: int = 0, **save_kwargs):
    model = build(family, seed)
    model.save_pretrained(folder, **save_kwargs)
    return model
