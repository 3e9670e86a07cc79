"""Speculative decoding on tiny random models (float32, CPU): greedy output identical to plain
decoding for the n-gram and the draft-model proposers on a dense and an MoE family in batches
that mix speculating, penalized (plain) and prefilling sequences with preemption and prefix
reuse; the sampled distribution unchanged (chi-square); page accounting under random
accept/reject/abort/preempt; stops and max_tokens inside an accepted run; bad configurations."""

import dataclasses
import random

import jax
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings, strategies as st

from pallasite.model import config_from_dict, forward_logits, init_params
from pallasite.serving.detokenize import TextStage
from pallasite.serving.engine import Engine, RequestOutput
from pallasite.serving.kv_pages import KVPages
from pallasite.serving.llm import SamplingParams
from pallasite.serving.scheduler import FINISHED, Scheduler, Sequence
from pallasite.serving.speculative import (NgramProposer, SpeculativeConfig, Speculator,
                                           SpecState, make_speculator, ngram_propose)

LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)
FAMILIES = {"llama": LLAMA,
            "mixtral": {**LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                        "num_experts_per_tok": 2, "intermediate_size": 64}}
DRAFT = config_from_dict({**LLAMA, "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 1, "num_attention_heads": 2,
                          "num_key_value_heads": 1})
K = 3


def peaked(config, seed):
    """Larger weights than the 0.02 init: peaked logits, greedy choices far from ties."""
    return jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x, init_params(config, seed=seed))


_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: _compiles.__setitem__(0, _compiles[0] + (
        event == "/jax/core/compile/backend_compile_duration")))


class LetterTokenizer:
    eos_token_ids = ()
    ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.ALPHABET[i % len(self.ALPHABET)] for i in ids)


NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def engines():
    """One engine per family, built for prompt lookup (24 pages of 4 tokens for 4 sequences of
    up to 64: preemption guaranteed)."""
    out = {}
    for family, raw in FAMILIES.items():
        config = config_from_dict(raw)
        out[family] = Engine(config, peaked(config, seed=0), LetterTokenizer(), num_pages=24,
                             page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=64, token_buckets=[16], page_buckets=[16],
                             speculative_config=NGRAM).warmup()
    return out


def with_proposer(engine, spec, draft=None):
    """The same compiled engine (its steps depend on k only) with another proposer, as the
    engine builds it; a draft model's buckets are compiled here, before any step."""
    e = engine
    e.spec = make_speculator(spec, target_config=e.config, params_dtype=np.float32,
                             pages=e.pages, max_num_seqs=e.max_num_seqs,
                             max_num_batched_tokens=e.scheduler.budget,
                             token_buckets=e.token_buckets, page_buckets=e.page_buckets,
                             draft=draft)
    e.spec.warmup()
    return e


def run(engine, requests):
    """requests: (id, prompt, SamplingParams, arrival step) -> id -> outputs. Checks that no
    step compiles and that the page pool stays consistent."""
    outs, step, pending = {}, 0, sorted(requests, key=lambda r: r[3])
    text = TextStage(engine.tokenizer)
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
        assert step < 1000
    return outs


def tokens(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def solo(logits_fn, vocab, prompt, n, sp):
    """Plain greedy decoding on the full-sequence forward (penalties by their formula), and the
    log-softmax of each step's raw logits."""
    ids, lps = list(prompt), []
    for _ in range(n):
        padded = np.zeros((1, 128), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.asarray(logits_fn(padded))[0, len(ids) - 1].astype(np.float64)
        lps.append(np.asarray(jax.nn.log_softmax(logits)))
        out = np.bincount(ids[len(prompt):], minlength=vocab)
        seen = np.isin(np.arange(vocab), ids)
        r = sp.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / r, logits * r), logits)
        logits -= sp.frequency_penalty * out + sp.presence_penalty * (out > 0)
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):], lps


def mixed_requests(seed):
    """Looping prompts (so prompt lookup finds matches), long ones (chunked prefill), two that
    share a prefix and arrive apart (prefix reuse), a penalized one (plain decoding) and one
    with logprobs."""
    rng = np.random.default_rng(seed)
    greedy = dict(temperature=0.0, ignore_eos=True)
    reqs = []
    for i in range(6):
        motif = rng.integers(0, 256, int(rng.integers(2, 6))).tolist()
        prompt = (motif * 20)[:int(rng.integers(5, 40))]
        reqs.append((f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(8, 20)), **greedy),
                     i // 2))
    shared = rng.integers(0, 256, 24).tolist()
    reqs.append(("prefix-a", shared + [1, 2], SamplingParams(max_tokens=10, **greedy), 0))
    reqs.append(("prefix-b", shared + [3], SamplingParams(max_tokens=10, **greedy), 12))
    reqs.append(("penalized", reqs[0][1], SamplingParams(max_tokens=12, repetition_penalty=1.5,
                                                         presence_penalty=0.5, **greedy), 1))
    reqs.append(("logprobs", reqs[1][1], SamplingParams(max_tokens=12, logprobs=3, **greedy), 2))
    return reqs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_speculation_is_token_for_token_plain_decoding(engines, family):
    config, params = engines[family].config, engines[family].params
    logits_fn = jax.jit(lambda ids: forward_logits(params, config, ids))
    reqs = mixed_requests(seed=3)
    want = {rid: solo(logits_fn, config.vocab_size, p, sp.max_tokens, sp) for rid, p, sp, _ in reqs}
    specs = [(NGRAM, None),
             ({"method": "draft_model", "model": "random", "num_speculative_tokens": K},
              (DRAFT, peaked(DRAFT, seed=1)))]
    for spec, draft in specs:
        engine = with_proposer(engines[family], spec, draft)
        prev = dict(engine.scheduler.stats())
        outs = run(engine, reqs)
        for rid, prompt, sp, _ in reqs:
            got, last = outs[rid], outs[rid][-1]
            assert tokens(got) == want[rid][0], (spec["method"], rid)
            assert (last.finish_reason, last.completion_tokens) == ("length", sp.max_tokens)
            assert "".join(o.text_delta for o in got) == LetterTokenizer().decode(want[rid][0])
            if sp.logprobs:
                lps = [lp for o in got for lp in o.logprobs]
                assert len(lps) == sp.max_tokens
                for lp, ref in zip(lps, want[rid][1]):
                    assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-4)
                    assert [t for t, _ in lp.top] == np.argsort(-ref)[:3].tolist()
        stats = engine.stats()
        assert outs["penalized"][-1].spec_proposed == 0  # penalties decode one token a step
        assert stats["spec_proposed_tokens"] > 0
        assert stats["preemptions"] > prev["preemptions"]
        assert stats["prefix_hit_tokens"] > prev["prefix_hit_tokens"]
        assert stats["pages_used"] == 0 and stats["running"] == 0
        if spec["method"] == "ngram":
            assert stats["spec_accepted_tokens"] > 0


def test_a_draft_that_is_the_target_accepts_everything_and_stops_inside_a_run(engines):
    """With the target as its own draft every proposal is accepted (its K/V kept in step with
    the target's), so each step emits k + 1 tokens; stops and max_tokens still land exactly."""
    e = engines["llama"]
    engine = with_proposer(e, {"method": "draft_model", "model": "self",
                               "num_speculative_tokens": K}, (e.config, e.params))
    prompt = [5, 17, 42, 9, 33]
    greedy = dict(temperature=0.0, ignore_eos=True)
    full = run(engine, [("full", prompt, SamplingParams(max_tokens=30, **greedy), 0)])["full"]
    full = tokens(full)
    assert engine.stats()["spec_mean_accepted"] == K + 1
    for n in (2, 7, 9, 13):  # max_tokens inside a run: never overshoot
        outs = run(engine, [("n", prompt, SamplingParams(max_tokens=n, **greedy), 0)])["n"]
        assert tokens(outs) == full[:n] and outs[-1].finish_reason == "length"
    # Runs: token 0 from the prefill, then K + 1 a step; a stop token's first occurrence that
    # is not the last of its run.
    at = next(i for i in range(8, 30) if full[i] not in full[:i] and (i - 1) % (K + 1) < K)
    outs = run(engine, [("tok", prompt, SamplingParams(max_tokens=30, stop_token_ids=[full[at]],
                                                       **greedy), 0)])["tok"]
    assert tokens(outs) == full[:at + 1] and outs[-1].finish_reason == "stop"
    assert len(outs[-1].new_token_ids) <= K  # the run was cut at the stop token
    text = LetterTokenizer().decode(full)
    stop = text[12:14]
    cut = text.find(stop)
    outs = run(engine, [("str", prompt, SamplingParams(max_tokens=30, stop=[stop], **greedy), 0)])
    got = outs["str"]
    assert "".join(o.text_delta for o in got) == text[:cut] and got[-1].finish_reason == "stop"
    assert len(tokens(got)) < 30


def test_sampling_with_speculation_keeps_the_target_distribution():
    """Many seeded draws of three tokens at temperature 1, the target proposing its own argmax
    as the draft (accepted often, rejected often): the second and third tokens' frequencies
    against their exact marginals (chi-square at p = 0.001). The same test rejects the
    distribution at temperature 2, so it can fail."""
    config = config_from_dict({**LLAMA, "vocab_size": 12, "hidden_size": 32,
                               "num_hidden_layers": 1})
    params = jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, init_params(config, seed=2))
    engine = Engine(config, params, num_pages=100, page_size=4, max_num_seqs=32,  # no warmup:
                    max_num_batched_tokens=128, max_model_len=12, token_buckets=[128],
                    page_buckets=[3], draft=(config, params),
                    speculative_config={"method": "draft_model", "model": "self",
                                        "num_speculative_tokens": 2})
    prompt, V, N = [1, 2, 3, 1, 2, 3, 1, 2], 12, 2000
    for i in range(N):
        engine.add_request(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=3,
                                                           ignore_eos=True))
    draws = {}
    while engine.has_unfinished():
        for o in engine.step():
            draws.setdefault(o.request_id, []).extend(o.new_token_ids)
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > N // 20  # many tokens came from accepted drafts
    seqs = np.array(list(draws.values()))

    def marginals(temperature):
        grid = np.array([prompt + [a, b] for a in range(V) for b in range(V)], np.int32)
        lg = np.asarray(forward_logits(params, config, grid), np.float64) / temperature
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p1 = p[0, len(prompt) - 1]  # after the prompt
        p2 = p[::V, len(prompt)]  # after (prompt, a), one row per a
        p3 = p[:, len(prompt) + 1].reshape(V, V, V)  # after (prompt, a, b)
        second = p1 @ p2
        third = np.einsum("a,ab,abc->c", p1, p2, p3)
        return second, third

    def chi2(counts, expected):
        keep = expected >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
        return ((obs - exp) ** 2 / exp).sum(), scipy.stats.chi2.ppf(0.999, len(obs) - 1)

    for pos, exact, hot in zip((1, 2), marginals(1.0), marginals(2.0)):
        counts = np.bincount(seqs[:, pos], minlength=V).astype(float)
        stat, limit = chi2(counts, N * exact)
        assert stat < limit, (pos, stat, limit)
        assert chi2(counts, N * hot)[0] > limit, pos


def test_a_speculating_engine_traces_its_steps_with_batch_invariant_splits(monkeypatch):
    """Its steps' attention is traced inside `tuning.batch_invariant` (fixed splits, so a
    verify row scores as its decode step would); a plain engine's only when asked. Products
    take the batch-invariant kernel only with batch_invariant=True."""
    from pallasite import kernels
    from pallasite.kernels import tuning
    seen, products, real, real_mm = [], [], kernels.ragged_paged_attention, kernels.matmul

    def spy(*args, **kw):
        seen.append(tuning.invariant())
        return real(*args, **kw)

    def spy_mm(*args, **kw):
        products.append(tuning.invariant_products())
        return real_mm(*args, **kw)
    monkeypatch.setattr(kernels, "ragged_paged_attention", spy)
    monkeypatch.setattr(kernels, "matmul", spy_mm)
    config = config_from_dict(LLAMA)
    for spec, asked, want in ((NGRAM, None, "attention"), (None, None, False),
                              (None, True, True), (NGRAM, False, False)):
        e = Engine(config, init_params(config, seed=0), num_pages=8, page_size=4,
                   max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32,
                   token_buckets=[8], page_buckets=[8], speculative_config=spec,
                   batch_invariant=asked)
        seen.clear()
        products.clear()
        e._lower((8, 8))
        assert seen == [bool(want)] * config.num_layers and e.batch_invariant == want
        assert products and set(products) == {want is True}


def test_batch_invariant_products_are_refused_on_a_mesh():
    import types
    config = config_from_dict(LLAMA)
    with pytest.raises(ValueError, match="not on a mesh"):
        Engine(config, init_params(config, seed=0), num_pages=8, page_size=4, max_num_seqs=2,
               max_num_batched_tokens=8, mesh=types.SimpleNamespace(devices=np.empty(2)),
               batch_invariant=True)


def test_ngram_proposes_what_followed_the_latest_match():
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 3, 1, 3) == [5, 1, 2]
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3], 3, 1, 3) == [5, 9, 2]  # n=2 match
    assert ngram_propose([7, 8, 9], 3, 1, 3) == []
    assert ngram_propose([7, 8, 9], 3, 2, 3) == []
    assert ngram_propose([4, 4, 4, 4], 5, 2, 2) == [4]  # what follows the latest match
    # The bytes of [256, 0] hold those of [1] one byte in: a match across tokens is no match.
    assert ngram_propose([256, 0, 7, 1], 2, 1, 1) == []


def lookup_reference(tokens, k, n_min, n_max):
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        for i in range(len(tokens) - 1 - n, -1, -1):
            if tokens[i:i + n] == tokens[len(tokens) - n:]:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 256, 65536, 16777216, 257]), max_size=40),
       st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_ngram_byte_search_matches_a_token_by_token_search(tokens, k, n_min, extra):
    """Tokens whose int32 bytes overlap when shifted: only whole-token matches count. The bytes
    kept across steps (as the proposer keeps them) give the same answer."""
    want = lookup_reference(tokens, k, n_min, n_min + extra)
    assert ngram_propose(tokens, k, n_min, n_min + extra) == want
    proposer = NgramProposer(SpeculativeConfig.parse({
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": n_min,
        "prompt_lookup_max": n_min + extra}))
    seq = Sequence("s", tokens[:1] or [0], SamplingParams())
    seq.spec = SpecState()
    for j in range(2, len(tokens) + 1):  # the sequence grows a token at a time
        seq.tokens = tokens[:j]
        assert proposer.plan(seq, k) == lookup_reference(tokens[:j], k, n_min, n_min + extra)


# -- page accounting under random accept / reject / abort / preempt ----------------------------
class RandomProposer:
    def __init__(self, rng, k):
        self.rng, self.k = rng, k

    def plan(self, seq, limit):
        return [self.rng.randrange(8) for _ in range(self.rng.randint(0, min(self.k, limit)))]

    def propose(self, chunks):
        pass

    def after_verify(self, seq, chunk, accepted):
        pass


class FakeEngine:
    """The engine's side of `Speculator.verify`: _accept (append, stop at max_output or token 7)
    and the page pool."""

    def __init__(self, scheduler):
        self.scheduler, self.pages = scheduler, scheduler.pages

    def _accept(self, seqs, out):
        outs = []
        for seq, row in zip(seqs, out):
            token = int(row[0])
            seq.num_pending -= 1
            seq.tokens.append(token)
            done = token == 7 or seq.num_output >= seq.max_output
            if done:
                self.scheduler.finish(seq)
            outs.append(RequestOutput(seq.request_id, [token], "", None, done,
                                      "stop" if done else None, len(seq.prompt_ids), 0,
                                      seq.num_output, 0.0, None))
        return outs


def check_no_page_is_doubly_owned(pages):
    owners = {}
    for seq, table in pages.tables.items():
        for p in table:
            if p >= 0:  # not DROPPED (kv_window.py)
                owners.setdefault(p, []).append(seq)
    for p, who in owners.items():  # only a cached full page (never written again) is shared
        assert len(who) == 1 or p in pages.key_of, (p, who)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(8, 24))
def test_page_accounting_under_random_accept_reject_abort_preempt(seed, k, num_pages):
    rng = random.Random(seed)
    pages = KVPages(num_pages, 4)
    max_len = min(num_pages * 4, 40)
    sched = Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=max_len)
    spec = Speculator(SpeculativeConfig("ngram", k), RandomProposer(rng, k))
    spec.install(sched)
    engine, live, n = FakeEngine(sched), [], 0
    for _ in range(60):
        if rng.random() < 0.4:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, max_len // 2))]
            seq = Sequence(f"s{n}", prompt, None, spec=SpecState())
            seq.max_output = rng.randint(1, max_len - len(prompt))
            sched.add(seq)
            live.append(seq)
            n += 1
        if live and rng.random() < 0.15:
            sched.finish(live.pop(rng.randrange(len(live))))  # abort, in any state
        spec.plan(sched.running, sched.budget - len(sched.running), max_len)
        chunks = sched.schedule()
        spec.propose(chunks)
        items = []
        for c in chunks:
            if c.samples and c.seq.status != FINISHED:
                draft = c.seq.draft
                a = rng.randint(0, len(draft))
                rows = [[t] for t in draft[:a]] + [[8]] * (K + 2)  # 8: never a proposal
                items.append((c, np.array(rows[:len(draft) + 1])))
        spec.verify(engine, items)  # all of the step's sequences at once, as the engine does
        for c, _ in items:
            assert c.seq.status == FINISHED or c.seq.num_computed == c.seq.total_len - 1
        for seq in live:
            if seq.status != FINISHED:
                assert seq.num_output <= seq.max_output
        live = [s for s in live if s.status != FINISHED]
        pages.check()
        check_no_page_is_doubly_owned(pages)
    for seq in live:
        sched.finish(seq)
    pages.check()
    assert pages.stats()["pages_used"] == 0 and not pages.tables


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "num_speculative_tokens must be an int >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 16},
     r"\(16\) \+ 1 exceeds max_num_batched_tokens \(16\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown field"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model .* is required"),
    ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
     "no checkpoint"),
    ('{"method": "ngram", ', "not valid JSON"),
])
def test_bad_configurations_are_refused_at_construction(spec, message):
    config = config_from_dict(LLAMA)
    with pytest.raises(ValueError, match=message):
        Engine(config, peaked(config, 0), num_pages=8, page_size=4, max_num_seqs=2,
               max_num_batched_tokens=16, max_model_len=32, speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes():
    config = config_from_dict(LLAMA)
    other = dataclasses.replace(DRAFT, vocab_size=300)
    with pytest.raises(ValueError, match=r"\(300 tokens\).*\(256 tokens\)"):
        Engine(config, peaked(config, 0), num_pages=8, page_size=4, max_num_seqs=2,
               max_num_batched_tokens=16, max_model_len=32,
               speculative_config={"method": "draft_model", "model": "x",
                                   "num_speculative_tokens": 2}, draft=(other, None))
