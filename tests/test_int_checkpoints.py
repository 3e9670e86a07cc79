"""Integer-quantized checkpoints end to end: AWQ, GPTQ (act order) and compressed-tensors W4A16
folders load through `load_hf` into packed weights whose logits equal those of their
numpy-dequantized float twin, and a compressed-tensors folder generates the twin's greedy text
through `LLM(path)`."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import int_fixtures
import tok_fixtures
from int_fixtures import compressed_linear, ct_config
from pallasite.model import forward_logits, load_hf
from pallasite.model.loader import CheckpointError
from pallasite.model.quant_int import PackedInt, describe
from pallasite.serving.llm import LLM, SamplingParams

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FORMATS = {
    "compressed": (lambda rng, p, k, n: compressed_linear(rng, p, k, n, 32, sym=False),
                   ct_config(g=32, sym=False)),
    **int_fixtures.GROUP32,
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float")
    tok = tok_fixtures.byte_level(400)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, eos_token_id=tok.token_to_id("<|eos|>"),
        bos_token_id=tok.token_to_id("<|bos|>"))).save_pretrained(folder)
    tok_fixtures.save(tok, folder)
    return folder


def write_pair(float_dir, root, fmt):
    """(quantized folder, its float twin) with every decoder linear in `fmt`."""
    return int_fixtures.write_pair(float_dir, root, fmt, FORMATS,
                                   lambda module: module.endswith(LINEARS))


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_logits_equal_the_dequantized_twin(float_dir, tmp_path, fmt):
    qdir, twin = write_pair(float_dir, tmp_path, fmt)
    config, params = load_hf(qdir, dtype=jnp.float32)
    wq = params["layers_0"]["attn"]["wq"]
    assert isinstance(wq, PackedInt) and wq.bits == 4 and (wq.perm is not None) == (fmt == "gptq")
    assert describe(params) == "w4a16 g32"  # what ModelInfo reports
    _, twin_params = load_hf(twin, dtype=jnp.float32)
    tokens = jnp.asarray([[3, 17, 5, 99, 42, 7, 1, 250]])
    np.testing.assert_allclose(forward_logits(params, config, tokens),
                               forward_logits(twin_params, config, tokens), rtol=1e-4, atol=1e-4)


def twin_greedy(folder, prompt, n):
    """Greedy continuation by the full forward of the float twin, padded to one shape (causal:
    padding after a position does not change its logits)."""
    config, params = load_hf(folder, dtype=jnp.float32)
    ids = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (32 - len(ids))])
        ids.append(int(jnp.argmax(forward_logits(params, config, padded)[0, len(ids) - 1])))
    return ids[len(prompt):]


def test_compressed_tensors_generates_the_twins_text(float_dir, tmp_path):
    qdir, twin = write_pair(float_dir, tmp_path, "compressed")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(qdir, dtype=jnp.float32, max_model_len=64, num_pages=32, page_size=8,
             max_num_seqs=2, max_num_batched_tokens=16, token_buckets=[16],
             page_buckets=[8], warmup=False) as llm:  # compiles only the greedy steps' programs
        assert isinstance(llm.engine.params["layers_1"]["mlp"]["w_down"], PackedInt)
        prompt = llm.tokenizer.encode("The quick brown fox")
        got = llm.generate([prompt], sp)[0].token_ids
    assert got == twin_greedy(twin, prompt, 12)


def test_quantized_checkpoint_refuses_requantization(float_dir, tmp_path):
    qdir, _ = write_pair(float_dir, tmp_path, "awq")
    with pytest.raises(CheckpointError, match=r"already quantized \(awq\)"):
        load_hf(qdir, quantization="fp8")
