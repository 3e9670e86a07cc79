"""The scheduler on its own (no model): budgets, chunked prefill, admission, preemption, limits,
aborts. A fake device answers every sampling chunk with a token one step later, as the engine
does."""

import types

import pytest

from pallasite.serving.kv_pages import KVPages
from pallasite.serving.scheduler import FINISHED, RUNNING, WAITING, RequestError, Scheduler, Sequence


def make(num_pages=64, page_size=4, max_num_seqs=4, budget=16, max_model_len=64):
    pages = KVPages(num_pages, page_size)
    return Scheduler(pages, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len)


def seq(name, n, max_tokens=5, first=0):
    s = Sequence(name, list(range(first, first + n)), types.SimpleNamespace())
    s.max_output = max_tokens
    return s


def run_step(sched, inflight):
    """Schedule a step, then deliver the previous step's samples (token 7), finishing sequences
    that reached their length."""
    chunks = sched.schedule()
    for c in inflight:
        if c.samples and c.seq.status != FINISHED:
            c.seq.num_pending -= 1
            c.seq.tokens.append(7)
            if len(c.seq.output_ids) >= c.seq.max_output:
                sched.finish(c.seq)
    sched.pages.check()
    return chunks


def test_decode_first_then_prefill_chunks_in_arrival_order():
    sched = make(budget=16)
    a, b = seq("a", 6), seq("b", 30)
    sched.add(a)
    sched.add(b)
    c1 = run_step(sched, [])
    assert [(c.seq.request_id, c.start, c.length, c.samples) for c in c1] == [
        ("a", 0, 6, True), ("b", 0, 10, False)]
    c2 = run_step(sched, c1)  # a decodes on its pending token; b gets the rest of the budget
    assert [(c.seq.request_id, c.start, c.length, c.samples) for c in c2] == [
        ("a", 6, 1, True), ("b", 10, 15, False)]
    c3 = run_step(sched, c2)
    assert [(c.seq.request_id, c.length) for c in c3] == [("a", 1), ("b", 5)] and c3[1].samples
    assert all(sum(c.length for c in cs) <= 16 for cs in (c1, c2, c3))


def test_sequence_limit_and_admission_needs_pages():
    sched = make(num_pages=10, page_size=4, max_num_seqs=2, budget=32, max_model_len=40)
    seqs = [seq(f"s{i}", 12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    chunks = run_step(sched, [])
    assert [c.seq.request_id for c in chunks] == ["s0", "s1"]  # the sequence limit
    assert seqs[2].status == WAITING
    big = make(num_pages=10, page_size=4, max_num_seqs=4, budget=64, max_model_len=40)
    first, second = seq("x", 30), seq("y", 12)  # 8 pages, then 3 more + a reserve: must wait
    big.add(first)
    big.add(second)
    run_step(big, [])
    assert first.status == RUNNING and second.status == WAITING
    assert big.pages.stats()["pages_used"] == 8


def test_preemption_frees_the_newest_and_recomputes_it():
    sched = make(num_pages=6, page_size=4, max_num_seqs=3, budget=32, max_model_len=24)
    a, b = seq("a", 7, max_tokens=12), seq("b", 7, max_tokens=12, first=50)
    sched.add(a)
    sched.add(b)
    inflight, preempted_b = [], False
    for _ in range(40):
        inflight = run_step(sched, inflight)
        preempted_b |= b.status == WAITING and b.num_computed == 0 and len(b.output_ids) > 0
        if a.status == FINISHED and b.status == FINISHED:
            break
    assert preempted_b and sched.num_preemptions >= 1
    assert a.output_ids == [7] * 12 and b.output_ids == [7] * 12
    assert sched.pages.stats()["pages_used"] == 0
    sched.pages.check()


def test_recompute_after_preemption_includes_outputs():
    sched = make(num_pages=6, page_size=4, max_num_seqs=2, budget=32, max_model_len=16)
    a, b = seq("a", 5, max_tokens=10), seq("b", 5, max_tokens=10, first=20)
    sched.add(a)
    sched.add(b)
    inflight, seen = [], []
    for _ in range(60):
        inflight = run_step(sched, inflight)
        seen += [(c.seq.request_id, c.start, c.length) for c in inflight if c.length > 1]
        if a.status == b.status == FINISHED:
            break
    # b was admitted, preempted, and recomputed (after what the prefix cache kept) up to and
    # including the outputs it had.
    assert sched.num_preemptions >= 1
    assert max(start + n for name, start, n in seen if name == "b") > 6
    assert a.output_ids == b.output_ids == [7] * 10


def test_limits_are_named():
    sched = make(max_model_len=20)
    with pytest.raises(RequestError, match="max_model_len is 20"):
        sched.add(seq("long", 20))
    with pytest.raises(RequestError, match="empty"):
        sched.add(seq("empty", 0))
    with pytest.raises(ValueError, match="exceeds the KV pool"):
        make(num_pages=4, page_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(max_num_seqs=8, budget=4)


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_frees_pages_in_every_state(state):
    sched = make(num_pages=16, page_size=4, max_num_seqs=1, budget=8)
    a, b = seq("a", 20, max_tokens=50), seq("b", 6)
    sched.add(a)
    sched.add(b)
    inflight = run_step(sched, [])  # a prefills its first chunk; b waits (one sequence max)
    victim = {"waiting": b, "prefilling": a, "decoding": a}[state]
    while state == "decoding" and len(a.output_ids) < 2:
        inflight = run_step(sched, inflight)
    sched.finish(victim)
    sched.pages.check()
    assert victim.status == FINISHED and victim.request_id not in sched.pages.tables
    if victim is a:
        assert sched.pages.stats()["pages_used"] == 0
        inflight = run_step(sched, inflight)  # b is admitted into the freed pages
        assert b.status == RUNNING


def test_a_prefill_ending_mid_budget_leaves_the_rest_to_the_next_prompt():
    sched = make(budget=16)
    a, b = seq("a", 30), seq("b", 6, first=100)
    sched.add(a)
    sched.add(b)
    c1 = run_step(sched, [])
    c2 = run_step(sched, c1)
    assert [(c.seq.request_id, c.start, c.length) for c in c1] == [("a", 0, 16)]
    assert [(c.seq.request_id, c.start, c.length) for c in c2] == [("a", 16, 14), ("b", 0, 2)]


def test_paced_admits_the_longest_outputs_first():
    sched = make(max_num_seqs=2, budget=64)
    sched.pace = 4
    for name, out in [("a", 3), ("b", 9), ("c", 5), ("d", 9), ("e", 1)]:
        sched.add(seq(name, 4, max_tokens=out))
    assert [s.request_id for s in sched.waiting] == ["b", "d", "c", "a", "e"]
    assert sched.waiting_work == 5 * 4 + 3 + 9 + 5 + 9 + 1
    chunks = run_step(sched, [])
    assert [c.seq.request_id for c in chunks] == ["b", "d"]
    assert sched.waiting_work == 3 * 4 + 5 + 3 + 1
    sched.finish(sched.waiting[-1])  # aborting a waiting request takes its work out
    assert sched.waiting_work == 2 * 4 + 5 + 3


def test_unpaced_admits_in_arrival_order():
    sched = make()
    for name, out in [("a", 3), ("b", 9), ("c", 5)]:
        sched.add(seq(name, 4, max_tokens=out))
    assert [s.request_id for s in sched.waiting] == ["a", "b", "c"]


def test_paced_budget_spreads_the_work_over_the_longest_requests_steps():
    sched = make(num_pages=256, max_num_seqs=8, budget=64, max_model_len=256)
    sched.pace = 8
    long, short = seq("long", 10, max_tokens=40), seq("short", 30, max_tokens=2)
    sched.add(long)
    sched.add(short)
    # 10 + 40 + 30 + 2 = 82 tokens to compute over the 40 steps the long request needs: 3 a
    # step, under the floor of 8.
    assert sched._step_budget() == 8
    chunks = run_step(sched, [])
    assert [(c.seq.request_id, c.length) for c in chunks] == [("long", 8)]
    # The long one has 2 + 40 tokens left, 40 of them steps; with six more short ones waiting,
    # 42 + 7 x 32 = 266 over 40: 7 a step, still the floor.
    for name in "abcdef":
        sched.add(seq(name, 30, max_tokens=2, first=100))
    assert sched._step_budget() == 8
    for name in "ghijklmnopqrst":  # 42 + 21 x 32 = 714 over 40: 18 a step
        sched.add(seq(name, 30, max_tokens=2, first=200))
    assert sched._step_budget() == 18
    chunks = run_step(sched, chunks)  # the long prompt's last 2 tokens, then the oldest short
    assert [(c.seq.request_id, c.length) for c in chunks] == [("long", 2), ("short", 16)]


def test_a_lone_request_is_not_paced():
    sched = make(budget=16)
    sched.pace = 4
    sched.add(seq("a", 30, max_tokens=50))
    assert sched._step_budget() == 16
    assert [c.length for c in run_step(sched, [])] == [16]


def test_paced_prompts_are_not_counted_as_steps():
    # Long prompts, short outputs: the batch needs few steps, so pacing leaves the budget whole.
    sched = make(num_pages=512, max_num_seqs=8, budget=256, max_model_len=512)
    sched.pace = 8
    for i in range(8):
        sched.add(seq(f"p{i}", 200, max_tokens=4, first=1000 * i))
    run_step(sched, [])
    # 8 x 204 - 256 computed over the 4 steps a request still needs: the whole budget
    assert sched._step_budget() == 256
