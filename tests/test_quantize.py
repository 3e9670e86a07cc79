"""`pallasite quantize` on a tiny model: the compressed-tensors folder it writes reads back as
the weights it reports, and AWQ and GPTQ reconstruct the calibration activations' outputs better
than round-to-nearest."""

import json

import numpy as np
import pytest
import torch
import transformers

import tok_fixtures
from pallasite.model import int_formats
from pallasite.tools import quantize as q


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp")
    tok = tok_fixtures.byte_level(400)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, eos_token_id=tok.token_to_id("<|eos|>"),
        bos_token_id=tok.token_to_id("<|bos|>")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
        # a few outlier input channels, as trained models have, for AWQ to find
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 8
            layer.post_attention_layernorm.weight[:3] *= 8
    model.save_pretrained(folder)
    tok_fixtures.save(tok, folder)
    return folder


def run(model_dir, out, method, **kw):
    return q.quantize(model_dir, out, method=method, bits=4, group_size=32, samples=4,
                      seq_len=64, progress=False, **kw)


def test_awq_and_gptq_beat_rtn(model_dir, tmp_path):
    err = {m: np.mean([r["rel_err"] for r in run(model_dir, tmp_path / m, m)["linears"]])
           for m in ("rtn", "awq", "gptq")}
    assert err["awq"] < 0.95 * err["rtn"] and err["gptq"] < 0.9 * err["rtn"], err


def test_folder_reads_back(model_dir, tmp_path):
    out = tmp_path / "asym"
    run(model_dir, out, "rtn", symmetric=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    quant = int_formats.parse_quantization_config(cfg)
    from safetensors.numpy import load_file
    tensors = load_file(out / "model.safetensors")
    lin = int_formats.read_linear(quant, tensors.__getitem__, tensors.__contains__,
                                  "model.layers.0.mlp.down_proj", (96, 64))
    assert lin.zero is not None and lin.group_size == 32
    assert "lm_head.weight" in tensors and "model.layers.1.mlp.down_proj.weight" not in tensors
    # the library's own decompression gives the same weight
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    p = "model.layers.0.mlp.down_proj."
    codes = unpack_from_int32(torch.from_numpy(tensors[p + "weight_packed"]), 4,
                              torch.Size([64, 96])).numpy().astype(np.float32)
    zp = unpack_from_int32(torch.from_numpy(tensors[p + "weight_zero_point"]), 4,
                           torch.Size([64, 3]), packed_dim=0).numpy()
    rows = np.arange(96) // 32
    w = (codes - zp[:, rows]) * tensors[p + "weight_scale"][:, rows]
    np.testing.assert_allclose(lin.dequantize(), w.T, rtol=1e-6, atol=1e-7)
