"""The engine end to end on a tiny random model (float32, CPU): every request gets exactly its
solo output whatever shares its steps, prefix reuse, preemption, aborts, stops, seeded sampling,
penalties, logprobs, and no compilation after warm-up."""

import jax
import numpy as np
import pytest

from pallasite.model import config_from_dict, forward_logits, init_params
from pallasite.serving.detokenize import TextStage
from pallasite.serving.engine import Engine
from pallasite.serving.kv_pages import page_digest
from pallasite.serving.llm import SamplingParams
from pallasite.serving.scheduler import RequestError

CONFIG = config_from_dict(dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
# Larger weights than the 0.02 init make the logits peaked, so greedy choices are far from ties.
# Under one jit: eagerly the init pass compiles op by op, seconds at every collection.
PARAMS = jax.jit(lambda: jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x,
                                      init_params(CONFIG, seed=0)))()
GREEDY = dict(temperature=0.0, ignore_eos=True)

_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: _compiles.__setitem__(0, _compiles[0] + (
        event == "/jax/core/compile/backend_compile_duration")))


class LetterTokenizer:
    """Token i is one character, so text and stop strings are easy to reason about."""
    eos_token_ids = ()
    ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.ALPHABET[i % len(self.ALPHABET)] for i in ids)


@pytest.fixture(scope="module")
def big():
    engine = Engine(CONFIG, PARAMS, LetterTokenizer(), num_pages=96, page_size=4, max_num_seqs=8,
                    max_num_batched_tokens=32, max_model_len=128, token_buckets=[8, 32],
                    page_buckets=[8, 32])
    engine.warmup()
    engine.warm = engine.compilations
    return engine


@pytest.fixture(scope="module")
def small():
    """20 pages of 4 tokens for up to 4 sequences of up to 64 tokens: preemption guaranteed."""
    engine = Engine(CONFIG, PARAMS, num_pages=20, page_size=4, max_num_seqs=4,
                    max_num_batched_tokens=16, max_model_len=64, token_buckets=[4, 16],
                    page_buckets=[16])
    engine.warmup()
    engine.warm = engine.compilations
    return engine


_logits = jax.jit(lambda ids: forward_logits(PARAMS, CONFIG, ids))


def solo(prompt, n, sp=None):
    """Reference decoding without the engine: greedy on the full-sequence forward, penalties
    applied by their formula. Returns (tokens, logprobs of each raw distribution)."""
    sp = sp or SamplingParams(**GREEDY)
    ids, lps = list(prompt), []
    for _ in range(n):
        padded = np.zeros((1, 128), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.asarray(_logits(padded))[0, len(ids) - 1].astype(np.float64)
        lps.append(np.asarray(jax.nn.log_softmax(logits)))
        out = np.bincount(ids[len(prompt):], minlength=CONFIG.vocab_size)
        seen = np.isin(np.arange(CONFIG.vocab_size), ids)
        r = sp.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
        logits -= sp.frequency_penalty * out + sp.presence_penalty * (out > 0)
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):], lps


def run(engine, requests, max_steps=2000):
    """requests: (id, prompt, SamplingParams, arrival step). Returns id -> list of outputs."""
    outs, step, text = {}, 0, TextStage(engine.tokenizer)
    pending = sorted(requests, key=lambda r: r[3])
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, sp, _ = pending.pop(0)
            engine.add_request(rid, prompt, sp)
            text.start(rid, prompt)
        before = _compiles[0]
        for o in text.fill(engine.step()):  # text made after the step, as EngineLoop does
            outs.setdefault(o.request_id, []).append(o)
        assert _compiles[0] == before, "a step compiled something"
        engine.pages.check()
        step += 1
        assert step < max_steps
    for rid, got in outs.items():
        assert [o.finished for o in got] == [False] * (len(got) - 1) + [True], rid
    return outs


def tokens(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def prompts(n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_concurrent_requests_match_their_solo_outputs(big):
    rng = np.random.default_rng(0)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=int(rng.integers(3, 20)), **GREEDY), i // 2)
            for i, p in enumerate(prompts(12, 2, 60, seed=1))]
    outs = run(big, reqs)
    for rid, prompt, sp, _ in reqs:
        want, _ = solo(prompt, sp.max_tokens)
        last = outs[rid][-1]
        assert tokens(outs[rid]) == want, rid
        assert (last.finish_reason, last.completion_tokens, last.prompt_tokens) == (
            "length", sp.max_tokens, len(prompt))
        assert "".join(o.text_delta for o in outs[rid]) == LetterTokenizer().decode(want)
        assert last.arrival_time <= last.first_token_time
    assert big.stats()["pages_used"] == 0 and big.stats()["running"] == 0


def test_the_same_without_overlap(big):
    big.overlap = False
    try:
        reqs = [(f"s{i}", p, SamplingParams(max_tokens=6, **GREEDY), 0)
                for i, p in enumerate(prompts(3, 5, 40, seed=2))]
        outs = run(big, reqs)
    finally:
        big.overlap = True
    for rid, prompt, _, _ in reqs:
        assert tokens(outs[rid]) == solo(prompt, 6)[0]


def test_each_small_step_writes_its_logits_over_the_last_ones(monkeypatch):
    # A small step's output stays at one address (on the GPU its CUDA graph is then launched as
    # recorded, not updated every call first); larger steps take a new buffer.
    from pallasite.serving import engine as engine_module
    monkeypatch.setattr(engine_module, "KEPT_LOGITS_ROWS", 4)
    engine = Engine(CONFIG, PARAMS, num_pages=64, page_size=4, max_num_seqs=8,
                    max_num_batched_tokens=16, max_model_len=64, token_buckets=[4, 16],
                    page_buckets=[16])
    engine.warmup()
    assert sorted(engine._logits) == [4]
    before = engine._logits[4]
    address = before.unsafe_buffer_pointer()
    reqs = [(f"l{i}", p, SamplingParams(max_tokens=5, **GREEDY), 2 * i)
            for i, p in enumerate(prompts(6, 3, 12, seed=4))]
    outs = run(engine, reqs)  # steps of 4 and of 8 rows
    assert before.is_deleted() and engine._logits[4].unsafe_buffer_pointer() == address
    assert sorted(engine._logits) == [4]
    for rid, prompt, _, _ in reqs:
        assert tokens(outs[rid]) == solo(prompt, 5)[0]


def test_prefix_reuse_takes_fewer_pages_and_changes_nothing(big):
    first = prompts(1, 40, 41, seed=3)[0]
    second = first[:36] + [7, 8, 9, 10, 11]
    run(big, [("long", first, SamplingParams(max_tokens=3, **GREEDY), 0)])
    key, kept = big.pages.root, []  # the pages that hold the first request's 9 full pages
    for i in range(9):
        key = page_digest(key, first[4 * i:4 * i + 4])
        kept.append(big.pages.cache[key])
    big.add_request("reuse", second, SamplingParams(max_tokens=5, **GREEDY))
    outs = big.step()
    table = big.pages.table("reuse")
    assert table[:9] == kept and not set(table[9:]) & set(kept)  # 2 new pages, not 11
    outs += run(big, [])["reuse"]
    assert outs[-1].cached_tokens == 36
    assert tokens(outs) == solo(second, 5)[0]
    assert big.stats()["prefix_hit_tokens"] >= 36


def test_the_next_turn_finds_the_pages_its_answer_filled(big):
    """Pages that fill while a request decodes enter the prefix cache when it ends: a follow-up
    whose prompt holds the first prompt and its answer computes only what is new."""
    first = prompts(1, 10, 11, seed=21)[0]
    answer = tokens(run(big, [("turn1", first, SamplingParams(max_tokens=14, **GREEDY), 0)])
                    ["turn1"])
    follow = first + answer + [5, 6, 7]
    outs = run(big, [("turn2", follow, SamplingParams(max_tokens=4, **GREEDY), 0)])["turn2"]
    assert outs[-1].cached_tokens == (len(first) + len(answer) - 1) // 4 * 4 == 20
    assert tokens(outs) == solo(follow, 4)[0]
    big.pages.check()


def test_a_tiny_pool_preempts_and_everyone_still_gets_their_output(small):
    # Half of them use penalties: their history must survive being preempted and readmitted.
    reqs = [(f"p{i}", p, SamplingParams(max_tokens=20 + i, repetition_penalty=1.0 + 0.2 * (i % 2),
                                        frequency_penalty=0.3 * (i % 2), **GREEDY), 0)
            for i, p in enumerate(prompts(6, 10, 30, seed=4))]
    before = small.stats()["preemptions"]
    outs = run(small, reqs)
    assert small.stats()["preemptions"] > before
    for rid, prompt, sp, _ in reqs:
        assert tokens(outs[rid]) == solo(prompt, sp.max_tokens, sp)[0], rid
    stats = small.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == 20


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_in_any_state_frees_its_pages(small, state):
    others = [(f"{state}{i}", p, SamplingParams(max_tokens=8, **GREEDY), 0)
              for i, p in enumerate(prompts(4 if state == "waiting" else 1, 4, 8, seed=5))]
    victim = prompts(1, 40, 41, seed=6)[0] if state == "prefilling" else [1, 2, 3, 4, 5]
    for rid, p, sp, _ in others:
        small.add_request(rid, p, sp)
    small.add_request("victim", victim, SamplingParams(max_tokens=30, **GREEDY))
    seen = small.step()
    seq = small.seqs["victim"]
    while state == "decoding" and len(seq.output_ids) < 2:
        seen += small.step()
    assert seq.status == ("waiting" if state == "waiting" else "running")
    assert state != "prefilling" or 0 < seq.num_computed < len(victim)
    small.abort("victim")
    assert "victim" not in small.pages.tables
    small.pages.check()
    outs = run(small, [])
    assert [(o.finished, o.finish_reason) for o in outs["victim"]] == [(True, "abort")]
    assert small.stats()["pages_used"] == 0
    for rid, p, _, _ in others:
        assert tokens([o for o in seen if o.request_id == rid] + outs[rid]) == solo(p, 8)[0]


def test_stop_token_and_stop_string(big):
    prompt = prompts(1, 12, 13, seed=7)[0]
    want, _ = solo(prompt, 12)
    k = next(i for i in range(3, 12) if want[i] not in want[:i])
    text = LetterTokenizer().decode(want)
    stop = text[5:7]
    cut = text.find(stop)
    by_token = SamplingParams(max_tokens=12, stop_token_ids=[want[k]], **GREEDY)
    outs = run(big, [("tok", prompt, by_token, 0),
                     ("str", prompt, SamplingParams(max_tokens=12, stop=[stop], **GREEDY), 0)])
    assert tokens(outs["tok"]) == want[:k + 1] and outs["tok"][-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in outs["tok"]) == text[:k]  # the stop token adds no text
    assert outs["str"][-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in outs["str"]) == text[:cut]
    assert tokens(outs["str"]) == want[:cut + len(stop)]
    assert (outs["tok"][-1].stop_reason, outs["str"][-1].stop_reason) == (want[k], stop)


def test_text_is_made_after_the_step_except_for_stop_strings(big):
    """The engine detokenizes only rows with stop strings; the TextStage makes the rest, the
    same text either way."""
    prompt = prompts(1, 12, 13, seed=7)[0]
    want, _ = solo(prompt, 6)
    big.add_request("plain", prompt, SamplingParams(max_tokens=6, **GREEDY))
    big.add_request("stops", prompt, SamplingParams(max_tokens=6, stop=["@@"], **GREEDY))
    raw = []
    while big.has_unfinished():
        raw += big.step()
    assert {o.text_delta is None for o in raw if o.request_id == "plain"} == {True}
    assert None not in {o.text_delta for o in raw if o.request_id == "stops"}
    text = TextStage(big.tokenizer)
    text.start("plain", prompt)
    filled = text.fill(raw)
    for rid in ("plain", "stops"):
        got = "".join(o.text_delta for o in filled if o.request_id == rid)
        assert got == LetterTokenizer().decode(want), rid
    assert not text.detoks  # a finished request's state is dropped


def test_seeded_sampling_does_not_depend_on_the_batch(big):
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=11, max_tokens=12)
    prompt = prompts(1, 9, 10, seed=8)[0]
    alone = tokens(run(big, [("alone", prompt, sp, 0)])["alone"])
    crowd = [(f"c{i}", p, SamplingParams(temperature=0.8, max_tokens=10), i)
             for i, p in enumerate(prompts(6, 3, 50, seed=9))]
    together = run(big, crowd + [("again", prompt, sp, 2)])
    assert tokens(together["again"]) == alone
    assert len(set(alone)) > 1


def test_penalties_and_logprobs_match_the_reference(big):
    prompt = prompts(1, 30, 31, seed=10)[0]
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5,
                        presence_penalty=0.3, max_tokens=14, logprobs=3, ignore_eos=True)
    # The first request leaves the prompt's pages in the prefix cache; the second is admitted
    # over them and must still load its whole history.
    for rid in ("pen1", "pen2"):
        outs = run(big, [(rid, prompt, sp, 0)])[rid]
        want, ref_lps = solo(prompt, 14, sp)
        assert tokens(outs) == want
        lps = [lp for o in outs for lp in o.logprobs]
        for lp, ref in zip(lps, ref_lps):
            assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-4)
            assert [t for t, _ in lp.top] == list(np.argsort(-ref)[:3])
    assert outs[-1].cached_tokens > 0


def test_requests_that_cannot_be_served_name_the_limit(big):
    with pytest.raises(RequestError, match="max_model_len is 128"):
        big.add_request("huge", [1] * 128, SamplingParams())
    with pytest.raises(RequestError, match="vocab_size 256"):
        big.add_request("oov", [1, 256], SamplingParams())
    big.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        big.add_request("dup", [1, 2], SamplingParams())
    run(big, [])


def test_no_compilation_after_warmup(big, small):
    # Every step of every test above ran on executables compiled in warmup().
    # (T, P) forward buckets + a plain and a guided sampler per mode and sequence-axis size + the
    # history loader.
    assert big.compilations == big.warm == 2 * 2 + 1 * 3 * 2 + 1
    assert small.compilations == small.warm == 2 * 1 + 1 * 3 * 2 + 1


def test_token_buckets_start_at_two_slots():
    # A one-row step would run the small projections as slow multiply-reduces on GPU (see
    # MIN_TOKEN_BUCKET); a lone decode token is padded to two slots instead.
    engine = Engine(CONFIG, PARAMS, num_pages=8, page_size=4, max_num_seqs=1,
                    max_num_batched_tokens=16, max_model_len=32, page_buckets=[8])
    assert engine.token_buckets == [2, 4, 16]
    engine.warmup()
    out = run(engine, [("solo", [3, 1, 4], SamplingParams(**GREEDY, max_tokens=5), 0)])
    assert tokens(out["solo"]) == solo([3, 1, 4], 5)[0]
