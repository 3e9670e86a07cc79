"""The families beyond Llama's shape (YaRN and LongRoPE, fused Phi-3 projections, sliding
windows, Gemma): greedy generation through `LLM` equals `transformers`', and the paged cached
forward equals the uncached one, with prompts longer than the window where there is one.
(Logit parity for each is in test_model.py, which runs every family in hf_models.)"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_models
from pallasite.model import ConfigError, config_from_dict, forward_logits, init_kv_cache, load_hf
from pallasite.serving.llm import LLM, SamplingParams
from test_model import dense_logits, paged_step, rel_err

# LongRoPE generation stays within the pretraining length: past it transformers recomputes the
# whole cache with the long factors, which a paged cache does not (the keys it holds keep the
# rotation they were written with).
NEW = ["llama_yarn", "phi3", "phi3_longrope", "mistral_window", "qwen2_window", "gemma2", "gemma3", "gpt_oss"]
PROMPTS = [[5, 17, 99, 3, 42], [7] * 3 + [64, 12, 90, 33, 8, 120, 4, 6, 77], [11]]


def assert_greedy_equals_transformers(model, path):
    """24 greedy tokens through `LLM` from the checkpoint at `path` equal `model.generate`'s."""
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                               max_new_tokens=24, min_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    with LLM(path, max_model_len=48, num_pages=32, page_size=8, max_num_seqs=4,
             max_num_batched_tokens=16, token_buckets=[4, 16], page_buckets=[8],
             warmup=False) as llm:  # compiles only what the greedy steps use
        got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [g.token_ids for g in got] == want


@pytest.mark.parametrize("family", NEW)
def test_greedy_24_tokens_equal_transformers(family, tmp_path):
    overrides = dict(original_max_position_embeddings=64) if "longrope" in family else {}
    assert_greedy_equals_transformers(hf_models.save(family, tmp_path, config=overrides),
                                      tmp_path)


@pytest.mark.parametrize("family", NEW)
def test_paged_forward_matches_dense(family, tmp_path):
    hf_models.save(family, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    page_size, num_pages = 4, 64
    assert config.sliding_window is None or config.sliding_window < 12  # prompts pass it
    seqs = [rng.integers(0, config.vocab_size, n) for n in (23, 12)]
    dense = [np.asarray(dense_logits(params, config, s[None]))[0] for s in seqs]
    perm = rng.permutation(num_pages)
    page_tables = [perm[:16], perm[16:32]]
    kv = init_kv_cache(config, num_pages, page_size, jnp.float32)
    # Prefill seq 0 in chunks of 5, 11 and 4 while seq 1 prefills 9 at once, then decode both.
    plan = [[(0, 0, 5), (1, 0, 9)], [(0, 5, 16)], [(0, 16, 20)]]
    plan += [[(0, t, t + 1), (1, t - 11, t - 10)] for t in range(20, 23)]
    for chunks in plan:
        step = [(s, seqs[s][a:b], a) for s, a, b in chunks]
        logits, kv = paged_step(params, config, kv, step, page_tables, page_size, pad_to=(20, 3))
        for (s, a, b), row in zip(chunks, np.asarray(logits)):
            assert rel_err(row, dense[s][b - 1]) <= 1e-4, (s, b)


# -- MXFP4 (GPT-OSS experts) ---------------------------------------------------------------------

def mxfp4_from_definition(blocks, scales):
    """OCP Microscaling MXFP4, decoded bit by bit: each block of 32 FP4 E2M1 elements (sign,
    2 exponent bits with bias 1, 1 mantissa bit; exponent 0 is subnormal: 0.5 * mantissa) shares
    one E8M0 scale 2 ** (s - 127). Two elements a byte, the first in the low nibble."""
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*scales.shape, 32).astype(int)
    sign = np.where(codes & 0b1000, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 0b11, codes & 1
    magnitude = np.where(exponent == 0, 0.5 * mantissa,
                         2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))
    scale = 2.0 ** (scales.astype(np.float64) - 127)
    return (sign * magnitude * scale[..., None]).reshape(*scales.shape[:-1], -1)


def test_mxfp4_dequantization_follows_the_format():
    from pallasite.model.loader import dequantize_mxfp4
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 4), dtype=np.uint8)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 5, 128) and got.dtype == np.float32
    np.testing.assert_array_equal(got, mxfp4_from_definition(blocks, scales))


def test_gpt_oss_mxfp4_checkpoint_matches_transformers(tmp_path):
    """Expert weights that MXFP4 holds exactly: transformers runs them as floats, the loader
    reads them as blocks and scales."""
    import json
    from safetensors.numpy import load_file, save_file
    model = hf_models.build("gpt_oss", config=dict(intermediate_size=64))
    rng = np.random.default_rng(0)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(layer.mlp.experts, name)  # [E, in, out]
                e, n_in, n_out = w.shape
                blocks = rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8)
                scales = rng.integers(118, 123, (e, n_out, n_in // 32), dtype=np.uint8)
                w.copy_(torch.tensor(mxfp4_from_definition(blocks, scales)).transpose(1, 2))
                prefix = f"model.layers.{i}.mlp.experts.{name}"
                packed[prefix + "_blocks"], packed[prefix + "_scales"] = blocks, scales
    model.save_pretrained(tmp_path)
    tensors = {k: v for k, v in load_file(tmp_path / "model.safetensors").items()
               if not k.endswith(("gate_up_proj", "down_proj"))}
    (tmp_path / "model.safetensors").unlink()
    save_file({**tensors, **packed}, tmp_path / "model.safetensors")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    assert config.expert_weights == "mxfp4"
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 29))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    assert rel_err(forward_logits(params, config, jnp.asarray(ids)), want) <= 1e-4


def test_refusals_name_the_field():
    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    for raw, match in [
        (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        (dict(model_type="qwen2", quantization_config={"quant_method": "bitsandbytes"}),
         "bitsandbytes"),
        (dict(model_type="gemma2", use_bidirectional_attention=True), "bidirectional"),
        (dict(model_type="llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(model_type="mixtral", hidden_act="gelu_pytorch_tanh"), "hidden_act"),
        (dict(model_type="gemma3_text", layer_types=["chunked_attention"] * 2), "chunked"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**base, **raw})


@pytest.mark.parametrize("family", ["gemma2", "deepseek_v3"])
def test_cli_and_grpc_give_the_library_s_greedy_text(family, tmp_path, capsys):
    """A new family through every door: `pallasite generate` prints and the gRPC service returns
    what `LLM` generates greedily from the same checkpoint folder (with a tokenizer)."""
    import tok_fixtures
    from pallasite.cli import main as cli_main
    from pallasite.serving.client import Client
    from pallasite.serving.server import BackgroundServer
    tok = tok_fixtures.byte_level(400)
    if family == "deepseek_v3":
        import test_deepseek
        model = test_deepseek.build("v3")
    else:
        model = hf_models.build(family)
    model.resize_token_embeddings(tok.get_vocab_size())
    model.save_pretrained(tmp_path)
    tok_fixtures.save(tok, tmp_path)
    prompt, greedy = "def f(x):", dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = dict(max_model_len=48, num_pages=32, page_size=8, max_num_seqs=4,
                  max_num_batched_tokens=16, token_buckets=[4, 16], page_buckets=[8],
                  warmup=False)  # compiles only what the greedy steps use
    with LLM(tmp_path, **engine) as llm:
        want = llm.generate([prompt], SamplingParams(**greedy))[0]
        server = BackgroundServer(lambda: llm, family, host="127.0.0.1", port=0,
                                  metrics_port=0, grace_s=5).wait_ready(60)
        try:
            with Client(f"127.0.0.1:{server.port}", timeout=60) as client:
                got = client.generate(prompt, **greedy)
        finally:
            server.drain(0)
    assert list(got.token_ids) == want.token_ids and got.text == want.text
    assert cli_main(["generate", "--model", str(tmp_path), "--prompt", prompt, "--max-tokens",
                     "8", "--temperature", "0", "--ignore-eos", "--max-model-len", "48"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
