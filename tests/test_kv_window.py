"""Pages behind the sliding window go back to the pool when every layer slides: greedy outputs
stay those of the engine that keeps every page (and of transformers), a sequence holds about a
window of pages however long it gets, a pool too small for the full lengths serves them all
without preempting, and a model with any full-attention layer gives nothing back."""

import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_models
from pallasite.model import config_from_dict, load_hf
from pallasite.serving.engine import Engine
from pallasite.serving.kv_pages import DROPPED, KVPages
from pallasite.serving.kv_window import first_live_page, freeable_window
from pallasite.serving.llm import SamplingParams
from pallasite.serving.scheduler import FINISHED, Scheduler, Sequence
from pallasite.serving.speculative import SpeculativeConfig, Speculator, SpecState
from test_scheduler import run_step
from test_speculative import FakeEngine, RandomProposer, check_no_page_is_doubly_owned

WINDOW, PAGE = 16, 4
BOUND = -(-WINDOW // PAGE) + 1  # pages a decoding sequence needs: its window's, plus one it enters
CHUNK = 16  # max_num_batched_tokens
PREFILL_BOUND = -(-(WINDOW - 1 + CHUNK) // PAGE) + 1  # a chunk's tokens and its first's window
GREEDY = dict(temperature=0.0, ignore_eos=True)


def held(pages, rid):
    return sum(p != DROPPED for p in pages.tables[rid])


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral sliding on both layers (window 16) and an engine whose 40 pages of 4 hold
    160 tokens: four sequences of 100+ tokens need 100+ pages unless the window frees them."""
    path = tmp_path_factory.mktemp("mistral_window")
    model = hf_models.build("mistral_window", config=dict(sliding_window=WINDOW))
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        model.lm_head.weight.mul_(4)
    model.save_pretrained(path)
    config, params = load_hf(path, dtype=jnp.float32)
    engine = Engine(config, params, num_pages=40, page_size=PAGE, max_num_seqs=4,
                    max_num_batched_tokens=CHUNK, max_model_len=128, token_buckets=[4, 16],
                    page_buckets=[32])
    return model, engine


def run(engine, requests, abort=None):
    """requests: (id, prompt, max_tokens, arrival step). Checks the pool and the pages each
    decoding sequence holds after every step; `abort` = (id, step). Returns id -> outputs and
    the most pages any decoding sequence held; `run.most` holds the most pages any sequence held
    and the most sequences running at once."""
    out, pending, step, most = {}, sorted(requests, key=lambda r: r[3]), 0, 0
    run.most = (0, 0)
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, n, _ = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **GREEDY))
        if abort and step == abort[1]:
            engine.abort(abort[0])
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
        engine.pages.check()
        for seq in engine.scheduler.running:
            if seq.num_computed > len(seq.prompt_ids):  # decoding, its prompt done
                most = max(most, held(engine.pages, seq.request_id))
            run.most = (max(run.most[0], held(engine.pages, seq.request_id)),
                        max(run.most[1], len(engine.scheduler.running)))
        step += 1
        assert step < 1000
    return out, most


def tokens(out):
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in out.items()}


def prompts(n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_freeing_changes_no_output_and_bounds_the_pages_held(mistral):
    model, engine = mistral
    assert engine.scheduler.window == WINDOW
    long, other = prompts(2, 30, 40, seed=0)
    shared = long[:24] + [5, 6, 7]  # 6 pages of `long` from the prefix cache, 2 of them dead
    reqs = [("long", long, 80, 0), ("other", other, 60, 0), ("victim", other[:20], 70, 0),
            ("shared", shared, 50, 30)]
    abort = ("victim", 40)  # after its first pages went back
    out, most = run(engine, reqs, abort)
    stats = engine.stats()
    assert out["shared"][-1].cached_tokens == 24  # `long`'s first 6 pages, 2 of them behind
    assert out["victim"][-1].finish_reason == "abort"
    assert stats["window_pages_freed"] > 40 and most <= BOUND
    assert stats["pages_used"] == 0 and not engine.pages.tables
    engine.scheduler.window = None  # the same engine keeping every page
    try:
        kept, most_kept = run(engine, reqs, abort)
    finally:
        engine.scheduler.window = WINDOW
    got, want = tokens(out), tokens(kept)
    assert most_kept > 3 * most and engine.stats()["window_pages_freed"] == stats[
        "window_pages_freed"]
    assert len(got["long"]) == 80 and 0 < len(got["victim"]) < 70
    n = min(len(got["victim"]), len(want["victim"]))  # the abort may land elsewhere
    assert got["victim"][:n] == want["victim"][:n]
    assert {k: v for k, v in got.items() if k != "victim"} == {
        k: v for k, v in want.items() if k != "victim"}
    with torch.no_grad():  # and transformers agrees, 80 tokens past a 16-token window
        ref = model.generate(torch.tensor([long]), max_new_tokens=80, min_new_tokens=80,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got["long"] == ref[0, len(long):].tolist()


def test_a_pool_too_small_for_the_full_lengths_serves_everyone_at_once(mistral):
    _, engine = mistral
    reqs = [(f"r{i}", p, 60, 0) for i, p in enumerate(prompts(4, 60, 68, seed=1))]
    # Each prompt alone needs 15+ pages of 4 at admission without freeing, each sequence 30 by
    # its end; the pool has 40. Freeing, prompts take their pages chunk by chunk.
    before = engine.stats()["preemptions"]
    got, most = run(engine, reqs)
    assert engine.stats()["preemptions"] == before and most <= BOUND
    assert run.most == (PREFILL_BOUND, 4)
    engine.scheduler.window = None
    try:
        want, _ = run(engine, reqs)
    finally:
        engine.scheduler.window = WINDOW
    assert engine.stats()["preemptions"] > before  # without freeing the pool runs out
    got, want = tokens(got), tokens(want)
    assert got == want and all(len(t) == 60 for t in got.values())


def family_config(family, **overrides):
    config_cls, _, extra = hf_models.FAMILIES[family]
    return config_from_dict(config_cls(**{**hf_models.BASE, **extra, **overrides}).to_dict())


@pytest.mark.parametrize("family, window", [
    ("mistral_window", 8), ("qwen2_window", None), ("gemma2", None), ("gemma3", None),
    ("gpt_oss", None), ("llama", None)])
def test_only_a_model_sliding_on_every_layer_gives_pages_back(family, window):
    config = family_config(family)
    assert freeable_window(config) == window
    if family == "qwen2_window":  # every layer from max_window_layers on slides
        assert freeable_window(family_config(family, max_window_layers=0)) == 8


def test_a_draft_model_sharing_the_pages_must_slide_too():
    target, full = family_config("mistral_window"), family_config("llama")
    spec = lambda draft: type("S", (), {"proposer": type("P", (), {"model": type(
        "M", (), {"config": draft})})})
    assert freeable_window(target, spec(full)) is None
    assert freeable_window(target, spec(family_config("mistral_window", sliding_window=12))) == 13
    assert freeable_window(full, spec(target)) is None


def test_mixed_attention_engine_frees_nothing(tmp_path):
    """Qwen2 with full attention below max_window_layers: a generation well past the window
    keeps every page."""
    hf_models.save("qwen2_window", tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    engine = Engine(config, params, num_pages=16, page_size=PAGE, max_num_seqs=2,
                    max_num_batched_tokens=8, max_model_len=64, token_buckets=[8],
                    page_buckets=[16])
    assert engine.scheduler.window is None
    engine.add_request("a", list(range(3, 15)), SamplingParams(max_tokens=30, **GREEDY))
    while engine.has_unfinished():
        engine.step()
        for rid, table in engine.pages.tables.items():
            assert DROPPED not in table
            assert len(table) >= engine.pages.pages_for(engine.seqs[rid].num_computed)
    assert engine.stats()["window_pages_freed"] == 0 and engine.stats()["steps"] > 30


@pytest.mark.parametrize("seed", range(6))
def test_speculative_rollback_preemption_and_aborts_never_lose_a_live_page(seed):
    """The scheduler alone with random proposals, acceptances, aborts and a tight pool: after
    every step each running sequence still holds every page its next step can read, and the
    pool's counts stay exact."""
    rng = random.Random(seed)
    pages = KVPages(14, PAGE)
    sched = Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=56,
                      window=10)
    spec = Speculator(SpeculativeConfig("ngram", 3), RandomProposer(rng, 3))
    spec.install(sched)
    engine, live = FakeEngine(sched), []
    for n in range(80):
        if rng.random() < 0.4:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
            seq = Sequence(f"s{n}", prompt, None, spec=SpecState())
            seq.max_output = rng.randint(1, 56 - len(prompt))
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.1:
            sched.finish(live.pop(rng.randrange(len(live))))
        spec.plan(sched.running, sched.budget - len(sched.running), 56)
        chunks = sched.schedule()
        spec.propose(chunks)
        items = []
        for c in chunks:  # what the kernels read this step is still there
            table = pages.tables[c.seq.request_id]
            first, end = int(first_live_page(c.start, 10, PAGE)), pages.pages_for(c.start + c.length)
            assert len(table) >= end and DROPPED not in table[first:end]
            if c.samples and c.seq.status != FINISHED:
                a = rng.randint(0, len(c.seq.draft))
                rows = [[t] for t in c.seq.draft[:a]] + [[8]] * 5
                items.append((c, np.array(rows[:len(c.seq.draft) + 1])))
        spec.verify(engine, items)
        live = [s for s in live if s.status != FINISHED]
        pages.check()
        check_no_page_is_doubly_owned(pages)
    assert sched.window_pages_freed > 0
    for seq in live:
        sched.finish(seq)
    pages.check()
    assert pages.stats()["pages_used"] == 0 and not pages.tables


def test_prompts_take_pages_chunk_by_chunk_and_a_tight_pool_still_finishes_everyone():
    """Six prompts of 20 to 40 tokens generating to 48 in a pool of 12 pages (48 tokens): as
    many run at once as the window lets, each chunk finds its pages, and every sequence ends."""
    pages = KVPages(12, PAGE)
    sched = Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=48,
                      window=8)
    rng = random.Random(0)
    seqs = []
    for i in range(6):
        n = rng.randint(20, 40)
        seqs.append(Sequence(f"s{i}", list(range(n)), None))
        seqs[-1].max_output = 48 - n
        sched.add(seqs[-1])
    chunks, steps, most = [], 0, 0
    while any(s.status != FINISHED for s in seqs):
        chunks = run_step(sched, chunks)
        most = max(most, len(sched.running))
        for c in chunks:
            table = pages.tables[c.seq.request_id]
            first, end = int(first_live_page(c.start, 8, PAGE)), pages.pages_for(c.start + c.length)
            assert len(table) >= end and DROPPED not in table[first:end]
            assert sum(p != DROPPED for p in table) <= -(-(8 - 1 + 8) // PAGE) + 1
        steps += 1
        assert steps < 1000
    assert most >= 3 and pages.stats()["pages_used"] == 0


def test_a_draft_model_on_the_same_pages_speculates_past_the_window(mistral):
    """The model as its own draft: every proposal is accepted, so the draft trails the target
    by a token after each step, and the pages stay those its window (plus that token) needs."""
    model, plain = mistral
    reqs = [(f"d{i}", p, 50, 0) for i, p in enumerate(prompts(2, 20, 30, seed=2))]
    want, _ = run(plain, reqs)
    engine = Engine(plain.config, plain.params, num_pages=40, page_size=PAGE, max_num_seqs=4,
                    max_num_batched_tokens=CHUNK, max_model_len=128, token_buckets=[4, 16],
                    page_buckets=[32], draft=(plain.config, plain.params),
                    speculative_config={"method": "draft_model", "model": "self",
                                        "num_speculative_tokens": 3})
    assert engine.scheduler.window == WINDOW + 1
    got, most = run(engine, reqs)
    assert tokens(got) == tokens(want)
    stats = engine.stats()  # the draft computes what the target does: it is never wrong
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 50
    assert stats["window_pages_freed"] > 10
    assert most <= -(-(WINDOW + 3) // PAGE) + 1
