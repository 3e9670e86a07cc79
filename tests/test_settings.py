"""Engine sizes picked for the device: today's small ones on CPU, throughput-sized on a GPU."""

import jax
import jax.numpy as jnp
import pytest

from pallasite.model import config_from_dict
from pallasite.serving import settings

LLAMA_8B = config_from_dict(dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192))


def test_cpu_keeps_the_small_defaults():
    sizes = settings.engine_sizes(LLAMA_8B, jnp.float32, max_model_len=256, page_size=16)
    assert (sizes["max_num_seqs"], sizes["max_num_batched_tokens"]) == (32, 512)
    assert sizes["token_buckets"] is None and sizes["num_pages"] == 4 * 16


def test_gpu_sizes_from_free_memory(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(settings, "free_bytes", lambda device=None: 44 * 2**30)  # H100 after 8B
    sizes = settings.engine_sizes(LLAMA_8B, jnp.bfloat16, max_model_len=2048, page_size=16)
    page = 2 * 32 * 8 * 16 * 128 * 2
    assert sizes["num_pages"] == settings.coarse(int(0.85 * 44 * 2**30 // page))  # ~300k tokens
    assert sizes["max_num_seqs"] == 1024 and sizes["max_num_batched_tokens"] == 8192
    assert sizes["token_buckets"] == [2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536,
                                      2048, 4096, 8192]
    # A small pool gets fewer sequence slots; what the caller says is kept.
    monkeypatch.setattr(settings, "free_bytes", lambda device=None: 4 * 2**30)  # 27k tokens
    small = settings.engine_sizes(LLAMA_8B, jnp.bfloat16, max_model_len=2048, page_size=16)
    assert small["max_num_seqs"] == 64 and 64 in small["token_buckets"]
    given = settings.engine_sizes(LLAMA_8B, jnp.bfloat16, max_model_len=2048, page_size=16,
                                  num_pages=100, max_num_seqs=8, max_num_batched_tokens=64,
                                  token_buckets=[8, 64])
    assert given == dict(num_pages=100, max_num_seqs=8, max_num_batched_tokens=64,
                         token_buckets=[8, 64])


def test_offline_pacing_on_a_gpu_but_not_for_integer_weights(monkeypatch):
    from pallasite.model import config_from_dict as cfg, init_params, quant_int
    tiny = cfg(dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    params = init_params(tiny, 0)
    assert settings.default_pace(params) is None  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert settings.default_pace(params) == settings.PACE_TOKENS
    assert settings.default_pace(quant_int.quantize_params(params, "w4a16")) is None


def test_serve_is_not_paced(monkeypatch):
    import argparse
    from pallasite.serving import llm, server
    seen = {}
    monkeypatch.setattr(llm, "LLM", lambda model, **kw: seen.update(kw))
    args = argparse.Namespace(max_model_len=None, num_pages=None, page_size=16, max_num_seqs=None,
                              max_num_batched_tokens=None, token_buckets=None, page_buckets=None,
                              random_weights=False, dtype=None, model=None)
    server.llm_factory(args)()
    assert "pace" in seen and seen["pace"] is None


@pytest.mark.parametrize("backend,env,on", [("gpu", None, True), ("gpu", "0", False),
                                            ("cpu", None, False), ("cpu", "1", True)])
def test_steps_launch_on_a_thread_on_a_gpu_unless_told(monkeypatch, backend, env, on):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    if env is None:
        monkeypatch.delenv(settings.LAUNCH_THREAD_ENV, raising=False)
    else:
        monkeypatch.setenv(settings.LAUNCH_THREAD_ENV, env)
    assert settings.default_launch_thread() is on
