"""The host's per-step path at many sequences, with the device taken out: the scheduler's array
decode pass against the per-sequence rule it replaces, and the engine's bulk acceptance (stop
tokens, max_tokens, logprobs, aborts, preemption, prefix hits) against outputs known in advance.

The engine's compiled programs are replaced by stand-ins, so nothing compiles: the sampler draws
token (seed + 7 * index) % V for output index `index`, the rule a seeded sampler follows too (a
sample depends on the request's seed and the output index only), so every request's stream is
known whatever the batch, preemptions and recomputes do."""

import threading
import types
from functools import partial

import numpy as np
import pytest

from benchmarks.host_step import fake_device
from pallasite.model import config_from_dict, init_params
from pallasite.serving import sampling
from pallasite.serving.engine import Engine
from pallasite.serving.kv_pages import KVPages
from pallasite.serving.llm import SamplingParams
from pallasite.serving.scheduler import FINISHED, RUNNING, Chunk, Scheduler, Sequence

V = 64
SEED, INDEX = list(sampling.INT_FIELDS).index("seed"), list(sampling.INT_FIELDS).index("index")


def expected(seed: int, max_tokens: int, stops=()) -> tuple[list[int], str]:
    out = []
    while len(out) < max_tokens:
        out.append((seed + 7 * len(out)) % V)
        if out[-1] in stops:
            return out, "stop"
    return out, "length"


def fake_engine(overlap: bool, num_pages: int, launch_thread: bool = False) -> Engine:
    import jax
    config = config_from_dict(dict(model_type="llama", vocab_size=V, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=256))
    params = jax.tree.map(np.asarray, init_params(config, 0))
    engine = Engine(config, params, num_pages=num_pages, page_size=4, max_num_seqs=48,
                    max_num_batched_tokens=96, max_model_len=64, overlap=overlap,
                    page_buckets=[16], launch_thread=launch_thread)

    def draw(ints, S):  # a seeded sampler's rule: the seed and the output index only
        rows = ints[S:S + len(sampling.INT_FIELDS) * S].reshape(-1, S)
        return (rows[SEED] + 7 * rows[INDEX]) % V

    fake_device(engine, V, draw)
    # the threads the forward calls ran on, and a hook each call runs first
    engine.launch_threads, engine.before_forward = set(), lambda: None
    compile_now = engine._compile_now

    def recorded(key):
        exe = compile_now(key)

        def call(*args):
            engine.launch_threads.add(threading.current_thread().name)
            engine.before_forward()
            return exe(*args)
        engine._exe[key] = call
        return call
    engine._compile_now = recorded
    return engine


@pytest.mark.parametrize("overlap,launch_thread,quiet", [
    (True, False, False), (False, False, False), (True, True, False), (True, False, True)])
def test_bulk_acceptance_matches_known_streams(overlap, launch_thread, quiet):
    # short of pages: some sequences are preempted. With `quiet`, every other request asks for
    # its first and last outputs only (as LLM.generate does): those without logprobs get the
    # first token, then the rest as they end (an abort before the first token: one output).
    engine = fake_engine(overlap, num_pages=40, launch_thread=launch_thread)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, V, 12).tolist()
    reqs = {}
    for i in range(90):
        prompt = rng.integers(0, V, int(rng.integers(2, 20))).tolist()
        if i % 5 == 0:
            prompt = shared + prompt[:3]  # found in the prefix cache by later arrivals
        n, seed = int(rng.integers(1, 30)), int(rng.integers(0, 1000))
        stops = [int(rng.integers(0, V))] if i % 3 == 0 else []
        sp = SamplingParams(max_tokens=n, seed=seed, temperature=1.0, ignore_eos=True,
                            stop_token_ids=stops, logprobs=2 if i % 7 == 0 else None)
        reqs[f"r{i}"] = (prompt, sp, i // 10, expected(seed, n, stops))
    aborts = {"r4": 3, "r31": 6, "r57": 9, "r80": 12}
    outs, step, waiting = {}, 0, sorted(reqs, key=lambda r: reqs[r][2])
    while waiting or engine.has_unfinished():
        while waiting and reqs[waiting[0]][2] <= step:
            rid = waiting.pop(0)
            engine.add_request(rid, reqs[rid][0], reqs[rid][1],
                               quiet and int(rid[1:]) % 2 == 0)
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        engine.pages.check()
        sched = engine.scheduler  # running sequences' counts live in its per-slot arrays
        assert all(s.counts is sched and sched.live[s.slot]
                   and sched.total[s.slot] == len(s.tokens) + sched.pending[s.slot]
                   for s in sched.running)
        assert all(s.counts is None for s in engine.seqs.values() if s.status != RUNNING)
        step += 1
        assert step < 500
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["pages_used"] == 0 and stats["running"] == 0
    on_launch_thread = {n.startswith("pallasite-launch") for n in engine.launch_threads}
    assert on_launch_thread == {launch_thread}
    for rid, (prompt, sp, _, (want, reason)) in reqs.items():
        got = outs[rid]
        toks = [t for o in got for t in o.new_token_ids]
        assert [o.finished for o in got] == [False] * (len(got) - 1) + [True], rid
        assert all(o.prompt_tokens == len(prompt) for o in got), rid
        if quiet and int(rid[1:]) % 2 == 0 and not sp.logprobs:
            sizes = [len(o.new_token_ids) for o in got]  # its first token, the rest at the end
            if len(toks) >= 2:
                assert sizes == [1, len(toks) - 1], rid
            else:  # ended at (or before) its first token; [1, 0]: aborted just after it
                assert sizes in ([len(toks)], [1, 0]), rid
            assert got[-1].completion_tokens == len(toks), rid
        else:
            assert [o.completion_tokens for o in got if o.new_token_ids] == list(
                range(1, len(toks) + 1)), rid
        if toks:
            first = [o.first_token_time for o in got if o.new_token_ids]
            assert first[0] is not None and len(set(first)) == 1, rid
        if sp.logprobs:
            assert all(lp.token_id == t and lp.logprob == -0.5 and [i for i, _ in lp.top] == [t, t]
                       for o in got if o.new_token_ids for lp, t in zip(o.logprobs, o.new_token_ids))
        else:
            assert all(o.logprobs is None for o in got), rid
        if rid in aborts:
            assert got[-1].finish_reason == "abort" and toks == want[:len(toks)], rid
        else:
            assert (toks, got[-1].finish_reason) == (want, reason), rid


def reference_decode(sched):
    """The decode pass as one Python loop over the running sequences (the rule the array pass
    must follow exactly)."""
    chunks, prefilling, before = [], [], sched.num_preemptions
    for seq in list(sched.running):
        start, total = seq.num_computed, len(seq.tokens) + seq.num_pending
        if total - start != 1:
            if total - start > 1:
                prefilling.append(seq)
            continue
        if seq.status != RUNNING or total - len(seq.prompt_ids) >= seq.max_output:
            continue
        held = len(sched.pages.tables[seq.request_id]) * sched.pages.page_size
        if total > held and not sched._grow(seq, total):
            continue
        seq.num_computed, seq.num_pending = total, seq.num_pending + 1
        chunks.append(Chunk(seq, start, 1, True))
    return chunks, prefilling, sched.num_preemptions != before


def test_array_decode_pass_follows_the_per_sequence_rule():
    """Two schedulers take the same random arrivals, samples, finishes and aborts, one with the
    array decode pass and one with the reference loop: every step's chunks, page tables and
    preemptions agree, and the pool stays exact."""
    rng = np.random.default_rng(5)
    scheds = [Scheduler(KVPages(40, 4), max_num_seqs=24, max_num_batched_tokens=32,
                        max_model_len=60) for _ in range(2)]
    scheds[1]._decode = partial(reference_decode, scheds[1])
    seqs = [{}, {}]
    inflight = [[], []]
    for step in range(300):
        new = [(f"s{step}_{j}", rng.integers(0, 9, int(rng.integers(1, 14))).tolist(),
                int(rng.integers(1, 40))) for j in range(int(rng.integers(0, 3)))]
        abort = rng.random() < 0.1
        got = []
        for k, sched in enumerate(scheds):
            for rid, prompt, n in new:
                s = Sequence(rid, prompt, types.SimpleNamespace())
                s.max_output = n
                seqs[k][rid] = s
                sched.add(s)
            live = sorted(rid for rid, s in seqs[k].items() if s.status != FINISHED)
            if abort and live:
                sched.finish(seqs[k][live[len(live) // 2]])
            chunks = sched.schedule()
            for c in inflight[k]:  # the previous step's samples arrive
                if c.samples and c.seq.status != FINISHED:
                    c.seq.num_pending -= 1
                    c.seq.tokens.append(len(c.seq.tokens) % 5)
                    if len(c.seq.output_ids) >= c.seq.max_output:
                        sched.finish(c.seq)
            inflight[k] = chunks
            sched.pages.check()
            tables = {s.request_id: list(sched.page_table[s.slot, :len(sched.pages.tables[
                s.request_id])]) for s in sched.running}
            assert all(t == sched.pages.tables[r] for r, t in tables.items())
            got.append(([(c.seq.request_id, c.start, c.length, c.samples) for c in chunks],
                        tables, sched.num_preemptions))
        assert got[0] == got[1], step
    assert scheds[0].num_preemptions > 0


def test_a_failed_launch_on_the_launch_thread_surfaces_in_step():
    engine = fake_engine(True, num_pages=40, launch_thread=True)
    calls = []

    def fail_third():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
    engine.before_forward = fail_third
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    got = engine.step() + engine.step() + engine.step()  # the third launch fails...
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()  # ... and the next step, which waits for it, raises its error
    assert [t for o in got for t in o.new_token_ids] and engine._inflight is None


@pytest.mark.parametrize("launch_thread", [False, True])
def test_the_loop_delivers_a_step_past_a_failing_callback(launch_thread):
    from pallasite.serving.engine_loop import EngineLoop
    loop = EngineLoop(fake_engine(True, num_pages=40, launch_thread=launch_thread))
    got, finished = {f"r{i}": [] for i in range(4)}, threading.Semaphore(0)

    def on_output(rid, out):
        if rid == "r1":
            raise ValueError("the client went away")
        got[rid].append(out)
        if out.finished:
            finished.release()
    try:
        for i, rid in enumerate(got):
            sp = SamplingParams(max_tokens=6, seed=i, temperature=1.0, ignore_eos=True)
            loop.submit(rid, [1, 2, 3], sp, partial(on_output, rid), stream=False)
        assert all(finished.acquire(timeout=60) for _ in range(3))
    finally:
        loop.close()
    assert loop.error is None and got["r1"] == []
    for i in (0, 2, 3):
        outs = got[f"r{i}"]
        assert [t for o in outs for t in o.new_token_ids] == expected(i, 6)[0]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
