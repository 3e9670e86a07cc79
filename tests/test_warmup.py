"""Warm-up: the programs it compiles, the pairs it trims, and the persistent compilation cache."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.warmup_time import gpu_plan
from pallasite.model import config_from_dict, init_params
from pallasite.serving import settings
from pallasite.serving.engine import Engine
from pallasite.serving.llm import SamplingParams
from pallasite.serving.warmup import CompileCounter, compile_all, step_keys

CONFIG = config_from_dict(dict(
    model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
# Under one jit: eagerly the init pass compiles op by op, seconds at every collection.
PARAMS = jax.jit(lambda: jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x,
                                      init_params(CONFIG, seed=0)))()


def test_gpu_plan_of_the_8b_engine():
    # 16 token buckets x 2 page widths, all reachable; 12 sequence-axis sizes x 3 variants x
    # (free, guided); the history loader: the 105 programs an H100 warm-up compiled.
    got = gpu_plan()
    names = [n for n, _ in got["programs"]]
    assert len(got["token_buckets"]) == 16 and got["page_buckets"] == [64, 512]
    assert sum(n.startswith("step") for n in names) == 32
    assert sum(n.startswith("sampler") for n in names) == 12 * 3 * 2
    assert len(names) == len(set(names)) == 105


def reachable(token_buckets, page_buckets, max_seqs, page_size, max_len):
    """Every (T, P) some step can land in, by enumeration: n sequences (n <= N tokens), the
    longest context c, N <= n * c tokens."""
    out = set()
    for N, c in itertools.product(range(1, token_buckets[-1] + 1), range(1, max_len + 1)):
        if N <= min(max_seqs, N) * c:
            T = next(b for b in token_buckets if b >= N)
            P = next(b for b in page_buckets if b >= -(-c // page_size))
            out.add((T, P))
    return out


@pytest.mark.parametrize("tokens,pages,seqs,ps", [
    ([4, 16], [1, 8], 2, 2), ([2, 8, 32], [1, 2, 16], 3, 4), ([8, 32], [8, 32], 8, 4)])
def test_step_keys_are_the_reachable_pairs(tokens, pages, seqs, ps):
    got = step_keys(tokens, pages, seqs, ps)
    assert set(got) == reachable(tokens, pages, seqs, ps, pages[-1] * ps)
    assert [T * P for T, P in got] == sorted((T * P for T, P in got), reverse=True)


def test_cache_folder_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(settings.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.default_cache_dir() == str(tmp_path / "pallasite" / "xla")
    monkeypatch.setenv(settings.CACHE_ENV, "")
    assert settings.default_cache_dir() == ""
    assert settings.coarse(19334) == 19200 and settings.coarse(100) == 100
    assert settings.coarse(19334 + 40) == settings.coarse(19334 - 40)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A fresh persistent cache folder for this test; off again afterwards."""
    from jax._src import compilation_cache
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path))
    compilation_cache.reset_cache()
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


def test_trimmed_engine_loads_from_cache_and_compiles_nothing_after(cache):
    # (T=16, P=1) cannot occur: 5+ tokens from 2 sequences of at most 2 tokens of context.
    kw = dict(num_pages=24, page_size=2, max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=16, token_buckets=[4, 16], page_buckets=[1, 8])
    cold = Engine(CONFIG, PARAMS, **kw).warmup()
    assert sorted(cold._exe) == [(4, 1), (4, 8), (16, 8)]
    assert cold.warmup_report["programs"] == 3 + 6 + 1 == cold.compilations
    warm = Engine(CONFIG, PARAMS, **kw).warmup()
    assert warm.warmup_report["cache_hits"] >= 3 + 6  # the loader may come from jit's own cache
    ids = {"a": [5], "b": list(range(1, 12)), "c": [7, 8]}
    sp = dict(a=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              b=SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=3, ignore_eos=True),
              c=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={9: 50.0}))
    outs = {}
    with CompileCounter() as after:
        for engine in (cold, warm):
            for r in ids:
                engine.add_request(r, ids[r], sp[r])
            got = {}
            while engine.has_unfinished():
                for o in engine.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
            outs[engine] = got
    assert after.compiles == 0 and warm.compilations == warm.warmup_report["programs"]
    assert outs[cold] == outs[warm] and outs[cold]["c"] == [9, 9, 9]


def test_compile_all_counts_cache_hits(cache):
    assert settings.enable_compilation_cache() == str(cache)
    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    jobs = [lambda k=k: jax.jit(lambda x: x * k + 1).lower(x).compile() for k in range(3)]
    with CompileCounter() as first:
        compile_all(jobs, ["a", "b", "c"], workers=2)
    with CompileCounter() as second:
        out = compile_all(jobs, ["a", "b", "c"], workers=2)
    assert first.compiles == second.compiles == 3 and second.hits >= first.hits + 3
    assert float(out[2][0](np.ones(3, np.float32))[0]) == 3.0


def test_settled_heap_collects_less_often():
    import gc
    from pallasite.serving.warmup import settle_heap
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        settle_heap(young=5000)
        assert gc.get_threshold()[0] == 5000
        settle_heap(young=100)  # a higher threshold is kept
        assert gc.get_threshold()[0] == 5000
        made = [[i] for i in range(3000)]  # net new objects below the threshold: no collection
        assert gc.get_count()[0] >= 3000 and made
    finally:
        gc.set_threshold(*before)


def test_steps_compile_with_the_options_for_their_size(monkeypatch):
    """Past two tokens a GPU step turns XLA's Triton GEMMs off; the warm-up and a step compiled
    late ask for the options of their own bucket."""
    from pallasite import kernels
    from pallasite.serving import engine as engine_module
    monkeypatch.delenv(settings.TRITON_GEMM_ENV, raising=False)
    assert settings.compiler_options(8192) == {}  # CPU: XLA's own
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    off = {"xla_gpu_enable_triton_gemm": False}
    assert [settings.compiler_options(t) for t in (None, 1, 2, 3, 8192)] == [{}, {}, {}, off, off]
    monkeypatch.setenv(settings.TRITON_GEMM_ENV, "1")
    assert settings.compiler_options(8192) == {}
    # no W8A8 product lands in a step that keeps Triton GEMMs (their FP8 autotuning is slow)
    assert kernels.W8A16_MAX_ROWS == settings.TRITON_GEMM_MAX_TOKENS
    monkeypatch.undo()

    asked = []
    record = lambda tokens=None: asked.append(tokens) or {}
    monkeypatch.setattr(settings, "compiler_options", record)
    monkeypatch.setattr(engine_module, "compiler_options", record)
    eng = Engine(CONFIG, PARAMS, page_size=4, max_model_len=32, max_num_seqs=2,
                 max_num_batched_tokens=8, num_pages=32, token_buckets=[2, 8], page_buckets=[8])
    eng.warmup(workers=1)
    assert sorted(t for t in asked if t is not None) == [2, 8]
    asked.clear()
    eng._compile_now((2, 8))
    assert asked == [2]
