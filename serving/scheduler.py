"""The step scheduler: continuous batching with chunked prefill, prefix reuse and preemption.

A sequence always computes its tokens from `num_computed` on; a step that reaches its last token
samples the next one. That one rule covers prefill, chunked prefill, decode and the recompute of
a preempted sequence. Each step has a token budget and a sequence limit: running sequences in
decode get their one token first, the rest of the budget goes to prefill chunks, oldest first.

The engine runs one step ahead of its results, so a decoding sequence may have one sampled
token the host has not seen yet (`num_pending`): the step reads it straight from the device.

Each running sequence holds a slot (a row of the batch state the engine keeps between steps).
The scheduler keeps every slot's page table in one persistent array, `page_table`, written only
where pages change (admission, a decode step that crosses a page), so packing a step is a
gather, not a rebuild. The decode pass is the hot loop at high concurrency: it reads the running
sequences' slots into an array (their token counts live in per-slot arrays while they run),
decides every row with numpy, and runs Python per sequence only for the rare events (a page
filling up, a preemption). A step comes out as a `Step`: its rows as
arrays, decode rows first; `Step.chunks()` gives them as `Chunk`s where a caller wants those.

Pacing (`pace`, for offline batches): a batch takes at least as many steps as its longest
request has tokens to make, and a step of few rows costs a whole read of the weights. So a paced
scheduler admits the longest outputs first and spreads the tokens left to compute evenly over the
steps the longest request still needs, never under `pace` tokens a step (about where the
products' time meets the weights' read). The short requests then fill the steps the long ones
make anyway, instead of leaving a tail of near-empty steps.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from . import kv_window
from .kv_pages import KVPages

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class RequestError(ValueError):
    """A request that cannot be served as asked; the message names the limit."""


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: object  # a SamplingParams
    seed: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.time)
    tokens: list[int] = None  # prompt + the outputs the host knows
    # `num_pending` and `num_computed` (properties below) while it holds no slot; while it runs
    # they live in the scheduler's per-slot arrays (`counts`: the scheduler), so that a step
    # moves them for every row at once.
    _pending: int = 0
    _computed: int = 0
    counts: object = None
    status: str = WAITING
    slot: int = -1  # row of the device-side sampler state while running
    max_output: int = 1 << 30  # tokens it may generate (max_tokens, capped by the context)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    ever_admitted: bool = False
    # Two outputs are wanted (`LLM.generate`, the servers' unary calls): its first token, whose
    # time the caller measures, and at its end the rest of its tokens.
    quiet: bool = False
    first_token_time: float | None = None
    # The engine's per-request data: stop token ids, sampler row, detokenizer, text so far/sent.
    stop_ids: frozenset = frozenset()
    penalized: bool = False
    row: tuple = None
    detok: object = None
    text: str = ""
    sent: int = 0
    # Speculative decoding: tokens proposed to follow the newest one in the next step, and the
    # speculation's own state (speculative.SpecState).
    draft: list = dataclasses.field(default_factory=list)
    spec: object = None
    # Digests of its tokens' first full pages (kv_pages.chain_digests): each page hashed once.
    page_keys: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.prompt_ids = list(map(int, self.prompt_ids))
        if self.tokens is None:
            self.tokens = list(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Tokens sampled on the device, not yet seen by the host."""
        c = self.counts
        return self._pending if c is None else int(c.pending[self.slot])

    @num_pending.setter
    def num_pending(self, n: int):
        if self.counts is None:
            self._pending = n
        else:
            self.counts.pending[self.slot] = n

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in (or queued into) the pages."""
        c = self.counts
        return self._computed if c is None else int(c.computed[self.slot])

    @num_computed.setter
    def num_computed(self, n: int):
        if self.counts is None:
            self._computed = n
        else:
            self.counts.computed[self.slot] = n

    @property
    def total_len(self) -> int:
        return len(self.tokens) + self.num_pending

    @property
    def num_output(self) -> int:
        return self.total_len - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]


class Chunk(NamedTuple):
    """`length` tokens of `seq` from token index `start`; `samples`: the chunk ends at the
    sequence's last token, so the step samples a new one after it. A tuple: the decode pass
    makes one per running sequence per step, with `_new_chunk` (no Python-level __new__)."""
    seq: Sequence
    start: int
    length: int
    samples: bool


_new_chunk = tuple.__new__
_slot, _tokens = attrgetter("slot"), attrgetter("tokens")


class Step:
    """One step's rows as arrays: each row's sequence, slot, first token, token count, whether it
    samples, and the tokens its sequence's host list held when scheduled (`known`)."""
    __slots__ = ("seqs", "slots", "start", "length", "samples", "known")

    def __init__(self, seqs, slots, start, length, samples, known):
        self.seqs, self.slots, self.start, self.length = seqs, slots, start, length
        self.samples, self.known = samples, known

    def __len__(self):
        return len(self.seqs)

    @classmethod
    def from_chunks(cls, chunks) -> "Step":
        seqs = [c.seq for c in chunks]
        ints = lambda xs: np.fromiter(xs, np.int64, len(seqs))
        return cls(seqs, ints(map(_slot, seqs)), ints(c.start for c in chunks),
                   ints(c.length for c in chunks), np.fromiter((c.samples for c in chunks), bool,
                                                               len(seqs)),
                   ints(map(len, map(_tokens, seqs))))

    def __add__(self, other: "Step") -> "Step":
        return Step(self.seqs + other.seqs, *(np.concatenate([getattr(self, k), getattr(other, k)])
                                               for k in self.__slots__[1:]))

    def chunks(self) -> list[Chunk]:
        return [_new_chunk(Chunk, c) for c in zip(self.seqs, self.start.tolist(),
                                                   self.length.tolist(), self.samples.tolist())]


class Scheduler:
    def __init__(self, pages: KVPages, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, window: int | None = None, pace: int | None = None):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): every decoding sequence needs a token")
        if max_model_len > pages.num_pages * pages.page_size:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the KV pool "
                             f"({pages.num_pages} pages of {pages.page_size} tokens)")
        self.pages, self.max_num_seqs = pages, max_num_seqs
        self.budget, self.max_model_len = max_num_batched_tokens, max_model_len
        self.drafted = 0  # speculative tokens in the decode pass's chunks (speculative.py)
        self.pace = pace  # None: first come first served, the whole budget every step
        self.waiting: deque[Sequence] = deque()
        self.waiting_work = 0  # tokens the waiting sequences have to compute (`_work`)
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.released = np.zeros(max_num_seqs, np.int64)  # per slot: times it was given back
        # Page ids of each slot's sequence, zero past its last page (and before its window).
        self.page_table = np.zeros((max_num_seqs, pages.pages_for(max_model_len)), np.int32)
        # Per slot: the token count at which the sequence has made all its output (prompt +
        # max_output), and the tokens its pages hold.
        self.limit = np.zeros(max_num_seqs, np.int64)
        self.capacity = np.zeros(max_num_seqs, np.int64)
        # Per slot: its running sequence's num_computed and num_pending (where they live while
        # it runs: `Sequence.counts`), and its total_len, written wherever the scheduler changes
        # it (taking a sampled token leaves it as it is): the decode pass reads and moves them
        # as arrays, not as fields of every running sequence.
        self.computed = np.zeros(max_num_seqs, np.int64)
        self.pending = np.zeros(max_num_seqs, np.int64)
        self.total = np.zeros(max_num_seqs, np.int64)
        self.live = np.zeros(max_num_seqs, bool)  # slots held by a running sequence
        self.max_output = np.zeros(max_num_seqs, np.int64)  # per slot: its sequence's max_output
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0
        # With a sliding window on every layer (kv_window.py): pages wholly this many tokens
        # behind a step's first query are given back; `dropped`: leading pages given back, per slot.
        self.window = window
        self.dropped = np.zeros(max_num_seqs, np.int64)
        self.window_pages_freed = 0
        self.admitted: list[Sequence] = []  # admitted by the last schedule()

    # -- requests -----------------------------------------------------------------------------
    def check(self, prompt_ids):
        """Raise RequestError if a prompt can never be served."""
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty; it needs at least 1 token")
        if len(prompt_ids) >= self.max_model_len:
            pool = self.pages.num_pages * self.pages.page_size
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is "
                f"{self.max_model_len} (the KV pool holds {pool}), which must leave room for "
                "at least 1 generated token")

    def add(self, seq: Sequence):
        self.check(seq.prompt_ids)
        self.waiting_work += _work(seq)
        waiting = self.waiting
        if self.pace is None or not waiting or waiting[-1].max_output >= seq.max_output:
            waiting.append(seq)
        else:  # paced: longest output first, in arrival order among equals
            waiting.insert(bisect.bisect_right(waiting, -seq.max_output, key=_shorter), seq)

    def finish(self, seq: Sequence):
        """Take a sequence out in any state (done, stopped or aborted) and free what it holds."""
        if seq.status == RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
            self.waiting_work -= _work(seq)
        seq.status = FINISHED

    def _release(self, seq: Sequence):
        # Pages that filled while it decoded enter the prefix cache now, in one pass: a later
        # turn of the conversation, or this sequence recomputed after preemption, finds them.
        self.pages.cache_full_pages(seq.request_id, seq.tokens, seq.num_computed, seq.page_keys)
        self.pages.free(seq.request_id)
        self.free_slots.append(seq.slot)
        self.released[seq.slot] += 1
        self.live[seq.slot] = False
        seq._pending, seq._computed, seq.counts = int(self.pending[seq.slot]), 0, None
        seq.slot = -1

    def _preempt(self, seq: Sequence):
        """Give back a running sequence's pages; it is recomputed later (first in line)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.waiting_work += _work(seq)
        self.num_preemptions += 1

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        return self.schedule_step().chunks()

    def schedule_step(self) -> Step:
        self.admitted = []
        if self.window is not None and self.running:
            seqs = self.running
            slots = np.fromiter(map(_slot, seqs), np.int64, len(seqs))
            kv_window.drop_dead_pages(self, seqs, slots, self.computed[slots])
        rows, prefilling, preempted = self._decode()
        if not isinstance(rows, Step):  # a decode pass that makes chunks (speculative.py)
            rows = Step.from_chunks(rows)
        chunks, budget = [], self._step_budget() - len(rows) - self.drafted
        for seq in prefilling:  # prefills under way, oldest first
            if budget > 0 and seq.status == RUNNING:
                n = budget if self.window is None else kv_window.grow_for_chunk(
                    self, seq, min(budget, seq.total_len - seq.num_computed))
                if n:
                    chunks.append(self._chunk(seq, n))
                    budget -= chunks[-1].length
        while (not preempted and budget > 0 and self.waiting
               and len(self.running) < self.max_num_seqs and self._admit(self.waiting[0], budget)):
            self.waiting_work -= _work(self.waiting[0])
            chunks.append(self._chunk(self.waiting.popleft(), budget))
            budget -= chunks[-1].length
        # Later steps may share the pages these chunks fill: the device runs steps in order,
        # so their K/V are written before any later step reads them. (Pages that decoding
        # fills wait for the sequence's release: only its own later turns would share them.)
        self.pages.cache_pages_of((c.seq.request_id, c.seq.tokens, c.start + c.length,
                                   c.seq.page_keys) for c in chunks)
        return rows + Step.from_chunks(chunks) if chunks else rows

    def _step_budget(self) -> int:
        """The step's tokens: the whole budget, or paced (see the module's docstring) the
        tokens left to compute over the steps the longest request still needs. A lone request
        is never paced: there is nothing to spread."""
        if self.pace is None or len(self.running) + len(self.waiting) < 2:
            return self.budget
        left = np.where(self.live, self.limit - self.computed, 0)
        # a step takes one output token of each sequence, but a chunk of prompt
        outputs = np.minimum(left, self.max_output).max()
        steps = max(int(outputs), self.waiting[0].max_output if self.waiting else 1, 1)
        work = int(left.sum()) + self.waiting_work
        return min(self.budget, max(self.pace, -(-work // steps)))

    def _decode(self) -> tuple[Step, list[Sequence], bool]:
        """One token for every running sequence whose next token is its last known one, oldest
        first; the pool grows (or preempts the newest) only when a page fills up. Returns the
        decode rows, the running sequences with a prefill under way, and whether it preempted
        (then nothing new is admitted this step)."""
        seqs, n, before = list(self.running), len(self.running), self.num_preemptions
        slots = np.fromiter(map(_slot, seqs), np.int64, n)
        start, total = self.computed[slots], self.total[slots]
        known = total - self.pending[slots]  # the tokens its host list holds
        # A sequence whose pending token is its last ends when that token arrives.
        rows = (total - start == 1) & (total < self.limit[slots])
        prefilling = [seqs[i] for i in np.flatnonzero(total - start > 1).tolist()]
        grow = np.flatnonzero(rows & (total > self.capacity[slots]))
        if len(grow):
            self._grow_rows([seqs[i] for i in grow.tolist()], slots[grow], total[grow])
        if self.num_preemptions != before:  # the preempted are the newest: a suffix of seqs
            rows[len(self.running):] = False
        idx = np.flatnonzero(rows)
        dseqs = seqs if len(idx) == len(seqs) else [seqs[i] for i in idx.tolist()]
        if len(idx) != len(seqs):
            slots, start, known, total = (a[idx] for a in (slots, start, known, total))
        self.computed[slots], self.total[slots] = total, total + 1
        self.pending[slots] += 1  # (each sequence's num_computed and num_pending)
        step = Step(dseqs, slots, start, np.ones(len(idx), np.int64),
                    np.ones(len(idx), bool), known)
        return step, prefilling, self.num_preemptions != before

    def _grow_rows(self, seqs: list[Sequence], slots: np.ndarray, total: np.ndarray):
        """Pages for decode rows that crossed into a new page, oldest first: all at once when the
        pool has a page for each (free, then evicted from the prefix cache), else one by one
        (preempting)."""
        span = self.pages.page_size
        if (total <= self.capacity[slots] + span).all():
            pages = self.pages.grow_each_by_one([seq.request_id for seq in seqs])
            if pages is not None:
                self.page_table[slots, self.capacity[slots] // span] = pages
                self.capacity[slots] += span
                return
        for seq, t in zip(seqs, total.tolist()):
            if seq.status == RUNNING:  # not preempted while an older one grew
                self._grow(seq, t)

    def _grow(self, seq: Sequence, total: int) -> bool:
        """Pages for `total` tokens of a running sequence, preempting the newest running ones
        while the pool is short. False if `seq` itself was preempted."""
        table = self.pages.tables[seq.request_id]
        held = len(table)
        while not self.pages.grow(seq.request_id, total):
            self._preempt(self.running[-1])
            if seq.status != RUNNING:
                return False
        self.page_table[seq.slot, held:len(table)] = table[held:]
        self.capacity[seq.slot] = len(table) * self.pages.page_size
        return True

    def _chunk(self, seq: Sequence, budget: int) -> Chunk:
        n = min(seq.total_len - seq.num_computed, budget)
        chunk = Chunk(seq, seq.num_computed, n, seq.num_computed + n == seq.total_len)
        seq.num_computed += n
        seq.num_pending += chunk.samples  # its sample reaches the host a step later
        self.total[seq.slot] = seq.total_len  # (num_computed is its slot's already)
        return chunk

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Running state with cached prefix pages and pages for every known token, or nothing.
        A sequence whose last sampled token is still on its way waits for it. Under a window
        on every layer, pages only for its first chunk: the next ones come as it advances."""
        if seq.num_pending:
            return False
        pages, tokens = self.pages, seq.tokens
        hit = pages.share_prefix(seq.request_id, tokens[:-1], seq.page_keys)  # leave 1 to compute
        dead = 0 if self.window is None else int(kv_window.first_live_page(
            hit, self.window, pages.page_size))
        pages.drop(seq.request_id, 0, dead)  # shared pages its window has passed already
        # Keep a page per running sequence in reserve so admission does not force preemption.
        reserve = len(self.running) + 1 if self.running else 0
        upto = len(tokens) if self.window is None else min(len(tokens), hit + budget)
        need = pages.pages_for(upto) - len(pages.table(seq.request_id))
        if need + reserve > pages.num_available() or not pages.grow(seq.request_id, upto):
            pages.free(seq.request_id)
            return False
        if not seq.ever_admitted:
            seq.cached_tokens, seq.ever_admitted = hit, True
        self.prefix_hit_tokens += hit
        seq.status, seq.slot = RUNNING, self.free_slots.pop()
        self.computed[seq.slot], self.pending[seq.slot] = hit, 0  # none pending: see above
        seq.counts = self
        table = pages.table(seq.request_id)
        self.page_table[seq.slot, :len(table)] = table
        self.page_table[seq.slot, :dead] = 0  # given back: read by no kernel
        self.page_table[seq.slot, len(table):] = 0
        self.dropped[seq.slot] = dead
        self.limit[seq.slot] = len(seq.prompt_ids) + seq.max_output
        self.total[seq.slot] = len(tokens)
        self.capacity[seq.slot] = len(table) * pages.page_size
        self.live[seq.slot], self.max_output[seq.slot] = True, seq.max_output
        self.running.append(seq)
        self.admitted.append(seq)
        return True

    def stats(self) -> dict:
        return dict(running=len(self.running), waiting=len(self.waiting),
                    prefix_hit_tokens=self.prefix_hit_tokens, preemptions=self.num_preemptions,
                    window_pages_freed=self.window_pages_freed)


def _shorter(seq: Sequence) -> int:
    """The paced waiting queue's sort key: longest output first."""
    return -seq.max_output


def _work(seq: Sequence) -> int:
    """Tokens a waiting sequence will compute: its prompt, and its outputs as recomputed
    (preempted) or still to make."""
    return len(seq.prompt_ids) + seq.max_output
