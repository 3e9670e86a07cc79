"""Giving back the KV pages a sliding window has left behind.

A query at position p of a sliding layer with window W sees the keys at positions p - W < j <= p.
The Pallas kernel starts each block of queries at the page holding its first query's first
visible key (`kernels/paged.py`; tests/test_attention_features.py fills the pages before it with
NaN), so a page wholly before `q - W + 1`, q the smallest query position of a sequence in a
step, is never read in that step.
A sequence's queries only move forward: a step's first query is its `num_computed` when the
step is scheduled (a prefill chunk's first token, a decode token, or the newest token before
the speculative proposals), and no later step starts earlier (speculation rolls back only the
proposals, which come after it). Such a page is dead for that sequence for good.

So when every attention layer slides, each step first gives back, for every running sequence,
the pages wholly before `num_computed - W + 1`. The scheduler keeps how many leading pages each
slot has given back; their page-table entries read 0 (page 0 is a live page of some sequence,
as padding entries are) and the sequence's `KVPages` table holds DROPPED there. Nothing reads
them: the Pallas kernel never loads a tile before the window, and the `jnp` paths that gather
whole tables mask those keys out, as they mask padding. A page shared through the prefix cache
only loses this sequence's reference; a cached page stays findable until evicted.

Where any layer takes full attention (Gemma 2 and 3, GPT-OSS, Qwen2 below `max_window_layers`),
that layer reads every page, so nothing is given back. A draft model shares the target's page
tables, so it must slide on every layer too; its first query may trail the target's by one
token (after a step that accepted every proposal), so the window grows by one.

Pages are taken as late as they are given back early: a sequence is admitted with pages for its
first chunk only, and each later prefill chunk takes its own (`grow_for_chunk`), so a prompt
holds about a window and a chunk of pages at any time, as a generation holds about a window.
The pool must still hold `max_model_len` tokens (the scheduler checks), so a sequence alone
always fits.
"""

from __future__ import annotations

import numpy as np


def all_sliding_window(config) -> int | None:
    """The window when every attention layer of `config` slides, else None."""
    n = config.num_layers
    if config.is_mla or not all(config.is_sliding(i) for i in range(n)):  # MLA reads all pages
        return None
    return max(config.window(i) for i in range(n))


def freeable_window(config, speculator=None) -> int | None:
    """How far behind a step's first query a page must end to be given back (tokens), or None
    when some layer of the model (or of a draft model sharing its pages) attends to all."""
    window = all_sliding_window(config)
    draft = getattr(getattr(speculator, "proposer", None), "model", None)
    if window is None or draft is None:
        return window
    draft_window = all_sliding_window(draft.config)
    return None if draft_window is None else max(window, draft_window) + 1


def first_live_page(first_query, window: int, page_size: int):
    """The first page a query at `first_query` (or later) can read: scalars or arrays."""
    return np.maximum(np.asarray(first_query) - window + 1, 0) // page_size


def drop_dead_pages(sched, seqs, slots: np.ndarray, computed: np.ndarray):
    """Give back the pages of `seqs` (running, in `slots`, computed up to `computed`) that lie
    wholly before their window; only sequences whose window crossed a page boundary cost
    Python."""
    first = first_live_page(computed, sched.window, sched.pages.page_size)
    for i in np.flatnonzero(first > sched.dropped[slots]).tolist():
        slot, end = int(slots[i]), int(first[i])
        sched.window_pages_freed += sched.pages.drop(seqs[i].request_id,
                                                     int(sched.dropped[slot]), end)
        sched.page_table[slot, sched.dropped[slot]:end] = 0
        sched.dropped[slot] = end


def grow_for_chunk(sched, seq, want: int) -> int:
    """Pages for the next `want` tokens of the prefilling `seq`, or for as many as the pool has
    pages for; returns how many tokens its chunk takes (0: none this step). A chunk never
    preempts. The oldest prefill takes all the budget left, and a sequence is admitted behind
    it only when it reaches its prompt's end or leaves pages over, so at most one sequence is
    ever short in mid-prompt: the newest, the first that a decode row short of pages preempts.
    The pages it waits for come back as the others move on or end."""
    pages, start = sched.pages, seq.num_computed
    table = pages.tables[seq.request_id]
    held = len(table)
    want = min(want, (held + pages.num_available()) * pages.page_size - start)
    if want <= 0 or not pages.grow(seq.request_id, start + want):
        return 0
    sched.page_table[seq.slot, held:len(table)] = table[held:]
    sched.capacity[seq.slot] = len(table) * pages.page_size
    return want
