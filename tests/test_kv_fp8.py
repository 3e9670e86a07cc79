"""The FP8 KV cache through the library, the CLI and the page budget (the kernels' float8 paths
are in tests/test_attention_features.py; ModelInfo and /metrics in tests/test_server.py)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from pallasite.cli import build_parser
from pallasite.model import config_from_dict, init_params
from pallasite.serving import llm as llm_mod
from pallasite.serving.llm import LLM, SamplingParams
from pallasite.serving.metrics import _EngineCollector

CONFIG = config_from_dict(dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
# Peaked logits (weights x 6), so greedy choices are far from ties.
# Under one jit: eagerly the init pass compiles op by op, seconds at every collection.
PARAMS = jax.jit(lambda: jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x,
                                      init_params(CONFIG, seed=0)))()


def test_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp9' is not one of 'auto', 'fp8'"):
        LLM("/nonexistent", kv_cache_dtype="fp9")  # refused before anything loads
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--kv-cache-dtype", "fp9"])
        args = build_parser().parse_args([command, "--kv-cache-dtype", "fp8"])
        assert args.kv_cache_dtype == "fp8"


def test_fp8_pages_generate_like_the_default():
    kw = dict(max_model_len=64, num_pages=40, page_size=8, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=[8, 32], page_buckets=[8], warmup=False)
    prompts = [[5, 17, 99, 3, 250, 41, 7, 7, 8, 60, 61], [200, 1, 2]]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for name in ("auto", "fp8"):
        with LLM.from_params(CONFIG, PARAMS, kv_cache_dtype=name, **kw) as llm:
            outs[name] = [o.token_ids for o in llm.generate(prompts, sp)]
            layer = llm.engine.state[0][0]
            assert llm.engine.kv_cache_dtype == (jnp.float8_e4m3fn if name == "fp8"
                                                 else jnp.float32)
    assert layer[0].dtype == jnp.float8_e4m3fn and len(layer) == 4
    assert layer[2].shape == (CONFIG.num_kv_heads, 1, 1, 1) and layer[2].dtype == jnp.float32
    # e4m3 rounds K and V by up to 2^-4: the first tokens agree; later, near-ties may flip.
    assert [o[:4] for o in outs["fp8"]] == [o[:4] for o in outs["auto"]]
    assert outs["fp8"][0] == outs["auto"][0]
    info = list(_EngineCollector(llm.engine).collect())[0]
    assert info.samples[0].labels == {"dtype": "float8_e4m3fn"}


def test_page_budget_counts_bytes_by_dtype(monkeypatch):
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 2**30})
    monkeypatch.setattr(llm_mod.jax, "devices", lambda: [device])
    pages = {dt: llm_mod.default_num_pages(CONFIG, 16, dt, 128, 10**6)
             for dt in (jnp.bfloat16, jnp.float8_e4m3fn)}
    assert pages[jnp.float8_e4m3fn] // 2 == pages[jnp.bfloat16]  # floors of the same budget
