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
from test_model import paged_step, rel_err

# LongRoPE generation stays within the pretraining length: past it transformers recomputes the
# whole cache with the long factors, which a paged cache does not (the keys it holds keep the
# rotation they were written with).
NEW = ["llama_yarn", "phi3", "phi3_longrope", "mistral_window", "qwen2_window", "gemma2", "gemma3"]
PROMPTS = [[5, 17, 99, 3, 42], [7] * 3 + [64, 12, 90, 33, 8, 120, 4, 6, 77], [11]]


@pytest.mark.parametrize("family", NEW)
def test_greedy_24_tokens_equal_transformers(family, tmp_path):
    overrides = dict(original_max_position_embeddings=64) if "longrope" in family else {}
    model = hf_models.save(family, tmp_path, config=overrides)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                               max_new_tokens=24, min_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    with LLM(tmp_path, max_model_len=48, num_pages=32, page_size=8, max_num_seqs=4,
             max_num_batched_tokens=16, token_buckets=[4, 16], page_buckets=[8]) as llm:
        got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [g.token_ids for g in got] == want


@pytest.mark.parametrize("family", NEW)
def test_paged_forward_matches_dense(family, tmp_path):
    hf_models.save(family, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    page_size, num_pages = 4, 64
    assert config.sliding_window is None or config.sliding_window < 12  # prompts pass it
    seqs = [rng.integers(0, config.vocab_size, n) for n in (23, 12)]
    dense = [np.asarray(forward_logits(params, config, jnp.asarray(s)[None]))[0] for s in seqs]
    perm = rng.permutation(num_pages)
    page_tables = [perm[:16], perm[16:32]]
    kv = init_kv_cache(config, num_pages, page_size, jnp.float32)
    # Prefill seq 0 in chunks of 5, 11 and 4 while seq 1 prefills 9 at once, then decode both.
    plan = [[(0, 0, 5), (1, 0, 9)], [(0, 5, 16)], [(0, 16, 20)]]
    plan += [[(0, t, t + 1), (1, t - 11, t - 10)] for t in range(20, 23)]
    for chunks in plan:
        step = [(s, seqs[s][a:b], a) for s, a, b in chunks]
        logits, kv = paged_step(params, config, kv, step, page_tables, page_size)
        for (s, a, b), row in zip(chunks, np.asarray(logits)):
            assert rel_err(row, dense[s][b - 1]) <= 1e-4, (s, b)
