"""Published FP8 checkpoint forms, built here as each format defines them, loaded into the
quantized layout and checked against a plain numpy dequantization of the same tensors:
fine-grained FP8 with 128x128 `weight_scale_inv` blocks (DeepSeek-V3 / Qwen3-FP8), and
compressed-tensors `float-quantized` per channel (with static input scales and an `ignore`
list, on a mixture of experts) and per tensor, and `int-quantized` INT8 W8A8 (SmoothQuant's).
Bad scales and unsupported options are errors naming the tensor or option."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from pallasite.model import CheckpointError, forward_logits, load_hf, quant

IDS = np.random.default_rng(0).integers(0, 128, (2, 10)).astype(np.int32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def fp8_blocks(w: np.ndarray, bo: int, bi: int):
    """[out, in] -> (e4m3 values, float32 scale [out/bo, in/bi]) with value * scale = weight."""
    out, inn = w.shape
    blocks = np.abs(w).reshape(out // bo, bo, inn // bi, bi).max((1, 3))
    scale = np.maximum(blocks, 1e-12) / 448
    full = np.repeat(np.repeat(scale, bo, 0), bi, 1)
    q = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
    return q, torch.from_numpy(scale.astype(np.float32))


def numpy_dequant(q, scale):
    q = q.float().numpy()
    s = scale.numpy().reshape(scale.shape[0] if scale.ndim else 1, -1)
    return q * np.repeat(np.repeat(s, q.shape[0] // s.shape[0], 0), q.shape[1] // s.shape[1], 1)


def write(folder, model, tensors, quantization_config):
    """config.json with the quantization_config, the tensors as one safetensors file; and a
    plain float32 twin folder holding the numpy dequantization of every weight."""
    model.config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def on_disk(model, folder):
    """The tensors as `save_pretrained` writes them (per-expert names, not fused ones)."""
    from safetensors.torch import load_file
    model.save_pretrained(folder)
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def build_quantized(model, folder, scheme, ignore=()):
    """(FP8 tensors, their dequantized state dict) of every Linear weight not in `ignore`;
    the plain checkpoint saved to `folder` first."""
    tensors, plain = {}, {}
    for name, p in on_disk(model, folder).items():
        w = p.float().numpy()
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and w.ndim == 2 and "embed" not in name \
            and "norm" not in name
        if not linear or any(module.endswith(i) for i in ignore):
            tensors[name] = plain[name] = p
            continue
        if scheme == "int8":  # W8A8: symmetric int8 per output channel
            s = torch.from_numpy((np.abs(w).max(1, keepdims=True) / 127).astype(np.float32))
            q = torch.from_numpy(np.rint(w / s.numpy()).astype(np.int8))
            tensors[module + ".weight_scale"] = s  # [out, 1]
        elif scheme == "block":
            q, s = fp8_blocks(w, 128, 128)
            tensors[module + ".weight_scale_inv"] = s
        elif scheme == "channel":
            q, s = fp8_blocks(w, 1, w.shape[1])
            tensors[module + ".weight_scale"] = s  # [out, 1]
            tensors[module + ".input_scale"] = torch.tensor([0.02])
        else:  # per tensor
            q, s = fp8_blocks(w, *w.shape)
            tensors[module + ".weight_scale"] = s.reshape(1)
        tensors[name] = q
        plain[name] = torch.from_numpy(numpy_dequant(q, tensors[next(
            k for k in (module + ".weight_scale_inv", module + ".weight_scale") if k in tensors)]))
    return tensors, plain


def check_against_plain(tmp_path, model, tensors, plain, qc, kind, dtype=jnp.float8_e4m3fn):
    qdir, pdir = tmp_path / "fp8", tmp_path / "plain"
    qdir.mkdir()
    write(qdir, model, tensors, qc)
    for f in pdir.glob("*.safetensors"):  # the twin: the same folder, dequantized weights
        f.unlink()
    save_file({k: v.contiguous() for k, v in plain.items()}, str(pdir / "model.safetensors"))
    config, qp = load_hf(qdir, dtype=jnp.float32)
    _, pp = load_hf(pdir, dtype=jnp.float32)
    layer = qp["layers_0"]
    w = layer["attn"]["wq"]
    assert quant.is_quantized(w) and w.q.dtype == dtype
    assert quant.is_quantized(layer[kind]["w_down"]) and not quant.is_quantized(qp["lm_head"])
    deq = jax.tree.map(quant.dequantize, qp, is_leaf=quant.is_quantized)
    for a, b in zip(jax.tree.leaves(deq), jax.tree.leaves(pp)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert rel_err(forward_logits(qp, config, IDS), forward_logits(pp, config, IDS)) <= 1e-5
    return qdir, qp


def refusals(qdir):
    """refused(change, match): the folder's quantization_config changed by `change` fails to
    load with an error matching `match`."""
    original = (qdir / "config.json").read_text()

    def refused(change, match):
        cfg = json.loads(original)
        change(cfg["quantization_config"])
        (qdir / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=match):
            load_hf(qdir)
    return refused


def llama(hidden=128, heads=2, head_dim=64):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        max_position_embeddings=64, tie_word_embeddings=False)).eval()


def test_block_fp8_checkpoint(tmp_path):
    """128x128 blocks over two 64-wide heads: q_proj's block covers two heads, o_proj's input
    block likewise; the LM head stays in bf16 as such checkpoints ship it."""
    model = llama()
    tensors, plain = build_quantized(model, tmp_path / "plain", "block", ignore=("lm_head",))
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": [128, 128]}
    qdir, qp = check_against_plain(tmp_path, model, tensors, plain, qc, "mlp")
    assert qp["layers_0"]["attn"]["wq"].scale.shape == (1, 1, 1)  # one block over [128, 2, 64]
    w_down = qp["layers_0"]["mlp"]["w_down"]
    assert w_down.logical(w_down.scale).shape == (2, 1) and w_down.q.shape == (128, 256)

    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(2, 2)
    save_file(bad, str(qdir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj.weight_scale_inv has shape \(2, 2\)"):
        load_hf(qdir)
    del bad["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(bad, str(qdir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks tensor.*up_proj.weight_scale_inv"):
        load_hf(qdir)


def test_compressed_tensors_channel_moe_with_ignore(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    torch.manual_seed(1)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False)).eval()
    scheme = preset_name_to_scheme("FP8", ["Linear"])
    scheme.weights.strategy = "channel"
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                            ignore=["lm_head", "re:.*mlp.gate$"],
                            quantization_status="compressed").model_dump(mode="json")
    tensors, plain = build_quantized(model, tmp_path / "plain", "channel",
                                     ignore=("lm_head", "mlp.gate"))
    _, qp = check_against_plain(tmp_path, model, tensors, plain, qc, "moe")
    assert qp["layers_0"]["moe"]["w_gate"].scale.shape == (4, 1, 32)  # per expert and channel
    assert not quant.is_quantized(qp["layers_0"]["moe"]["router"])


def test_compressed_tensors_per_tensor_and_refusals(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    model = llama(hidden=64, heads=4, head_dim=16)
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8", ["Linear"])},
                            format="float-quantized", ignore=["lm_head"],
                            quantization_status="compressed").model_dump(mode="json")
    tensors, plain = build_quantized(model, tmp_path / "plain", "tensor", ignore=("lm_head",))
    qdir, qp = check_against_plain(tmp_path, model, tensors, plain, qc, "mlp")
    assert qp["layers_0"]["attn"]["wo"].scale.shape == (1, 1, 1)

    refused = refusals(qdir)
    refused(lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"),
            r"weights.strategy 'group' is not supported")
    refused(lambda q: q.update(format="pack-quantized"),
            r"type='float' is not supported")
    refused(lambda q: q.update(ignore=["lm_head", "o_proj"]),
            r"o_proj.weight is stored as fp8, but .* leaves its module unquantized")


def test_compressed_tensors_int8_w8a8(tmp_path):
    """llm-compressor's W8A8 preset: int8 weights per channel, int8 activations per token."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    model = llama(hidden=64, heads=4, head_dim=16)
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                            format="int-quantized", ignore=["lm_head"],
                            quantization_status="compressed").model_dump(mode="json")
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    tensors, plain = build_quantized(model, tmp_path / "plain", "int8", ignore=("lm_head",))
    qdir, qp = check_against_plain(tmp_path, model, tensors, plain, qc, "mlp", jnp.int8)
    wq = qp["layers_0"]["attn"]["wq"]
    assert wq.scheme == "int8" and wq.k_last == 1 and wq.q.shape == (4, 16, 64)
    refused = refusals(qdir)
    group = lambda q: q["config_groups"]["group_0"]
    refused(lambda q: group(q)["weights"].update(symmetric=False),
            r"weights.symmetric = False is not supported")
    refused(lambda q: group(q)["input_activations"].update(symmetric=False),
            r"input_activations.symmetric = False is not supported")
    refused(lambda q: group(q)["weights"].update(num_bits=4),
            r"weights.num_bits = 4 is not supported")
    refused(lambda q: group(q).update(format="float-quantized"), r"type = 'int' is not supported")
