"""Config and loader error cases: each names what is wrong."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
from pallasite.model import CheckpointError, ConfigError, load_config, load_hf

LLAMA = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
             num_hidden_layers=1, num_attention_heads=2)


def write_config(folder, **changes):
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


@pytest.mark.parametrize("changes, words", [
    (dict(model_type="gpt2"), "model_type 'gpt2'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling type 'dynamic'"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (dict(hidden_act="relu"), "hidden_act"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]),
     "mlp_only_layers"),
])
def test_unsupported_config_is_named(tmp_path, changes, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(write_config(tmp_path, **changes))


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="vocab_size"):
        load_config(tmp_path)


def test_qwen2_sliding_window_off_is_accepted(tmp_path):
    config = load_config(write_config(tmp_path, model_type="qwen2", sliding_window=64,
                                      use_sliding_window=False))
    assert config.qkv_bias


@pytest.fixture
def checkpoint(tmp_path):
    hf_models.save("llama", tmp_path)
    return tmp_path, tmp_path / "model.safetensors"


def test_missing_tensor(checkpoint):
    folder, file = checkpoint
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf(folder)


def test_extra_tensor(checkpoint):
    folder, file = checkpoint
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.extra.weight.*model.safetensors"):
        load_hf(folder)


def test_wrong_shape(checkpoint):
    folder, file = checkpoint
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=r"k_proj.weight in model.safetensors has shape \(8, 64\)"):
        load_hf(folder)


def test_unreadable_file(checkpoint):
    folder, file = checkpoint
    file.write_bytes(np.random.default_rng(0).bytes(1000))
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        load_hf(folder)


def test_no_safetensors(checkpoint):
    folder, file = checkpoint
    file.rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_hf(folder)
