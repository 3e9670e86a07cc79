"""The persistent batch state under load: 72 greedy requests through 64 sequence slots on the
tiny model, with a pool small enough to preempt, shared prefixes that hit the prefix cache and
aborts in every state, first come first served and paced (the scheduler's offline policy), with
each step's programs launched on the engine's thread or on a launch thread of their own.
Every request that is not aborted gets exactly its solo output, and every running sequence's
slot row always holds its page table."""

import numpy as np
import pytest

from pallasite.serving.engine import Engine
from pallasite.serving.llm import SamplingParams
from test_engine import CONFIG, GREEDY, PARAMS, solo, tokens


def check_slots(engine):
    sched = engine.scheduler
    for seq in sched.running:
        table = engine.pages.table(seq.request_id)
        assert list(sched.page_table[seq.slot, :len(table)]) == table, seq.request_id
        assert not sched.page_table[seq.slot, len(table):].any(), seq.request_id
    slots = [seq.slot for seq in sched.running]
    assert len(set(slots)) == len(slots) and not set(slots) & set(sched.free_slots)


@pytest.mark.parametrize("pace,launch_thread", [(None, False), (16, False), (None, True)])
def test_many_sequences_preemption_prefix_hits_and_aborts(pace, launch_thread):
    engine = Engine(CONFIG, PARAMS, num_pages=64, page_size=4, max_num_seqs=64,
                    max_num_batched_tokens=128, max_model_len=96, token_buckets=[64, 128],
                    page_buckets=[24], pace=pace, launch_thread=launch_thread)
    engine.warmup()
    rng = np.random.default_rng(12)
    shared = rng.integers(0, CONFIG.vocab_size, 24).tolist()
    reqs = []
    for i in range(72):
        prompt = rng.integers(0, CONFIG.vocab_size, int(rng.integers(2, 40))).tolist()
        if i % 6 == 5:  # a shared 24-token prefix: later arrivals find its pages cached
            prompt = shared + prompt[:8]
        reqs.append((f"q{i}", prompt, int(rng.integers(8, 25)), i // 12))
    aborts = {"q3": 1, "q20": 2, "q41": 4, "q66": 6, "q70": 9}  # request -> step to abort at
    outs, step, pending, budgets = {}, 0, list(reqs), set()
    while pending or engine.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, n, _ = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **GREEDY))
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        engine.pages.check()
        check_slots(engine)
        budgets.add(engine.scheduler._step_budget())
        waiting = engine.scheduler.waiting  # the paced budget's count of their work
        assert engine.scheduler.waiting_work == sum(len(s.prompt_ids) + s.max_output
                                                    for s in waiting)
        step += 1
        assert step < 1000
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] >= 24
    assert (budgets == {128}) == (pace is None)  # paced steps took less than the whole budget
    assert stats["pages_used"] == 0 and stats["running"] == 0
    for rid, prompt, n, _ in reqs:
        got = outs[rid]
        assert [o.finished for o in got] == [False] * (len(got) - 1) + [True], rid
        if rid in aborts:
            assert got[-1].finish_reason == "abort", rid
            continue
        assert got[-1].finish_reason == "length", rid
        assert tokens(got) == solo(prompt, n)[0], rid
