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
gather, not a rebuild. The decode pass is the hot loop at high concurrency: it does a few
integer tests per sequence and touches the page pool only when a page fills up.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import NamedTuple

import numpy as np

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
    num_pending: int = 0  # sampled on the device, not yet seen by the host
    num_computed: int = 0  # tokens whose K/V are in (or queued into) the pages
    status: str = WAITING
    slot: int = -1  # row of the device-side sampler state while running
    max_output: int = 1 << 30  # tokens it may generate (max_tokens, capped by the context)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    ever_admitted: bool = False
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

    def __post_init__(self):
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if self.tokens is None:
            self.tokens = list(self.prompt_ids)

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


class Scheduler:
    def __init__(self, pages: KVPages, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): every decoding sequence needs a token")
        if max_model_len > pages.num_pages * pages.page_size:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the KV pool "
                             f"({pages.num_pages} pages of {pages.page_size} tokens)")
        self.pages, self.max_num_seqs = pages, max_num_seqs
        self.budget, self.max_model_len = max_num_batched_tokens, max_model_len
        self.drafted = 0  # speculative tokens in the decode pass's chunks (speculative.py)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        # Page ids of each slot's sequence, zero past its last page.
        self.page_table = np.zeros((max_num_seqs, pages.pages_for(max_model_len)), np.int32)
        self.prefix_hit_tokens = 0
        self.num_preemptions = 0
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
        self.waiting.append(seq)

    def finish(self, seq: Sequence):
        """Take a sequence out in any state (done, stopped or aborted) and free what it holds."""
        if seq.status == RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        seq.status = FINISHED

    def _release(self, seq: Sequence):
        self.pages.free(seq.request_id)
        self.free_slots.append(seq.slot)
        seq.slot, seq.num_computed = -1, 0

    def _preempt(self, seq: Sequence):
        """Give back a running sequence's pages; it is recomputed later (first in line)."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        self.admitted = []
        chunks, prefilling, preempted = self._decode()
        decoded, budget = len(chunks), self.budget - len(chunks) - self.drafted
        for seq in prefilling:  # prefills under way, oldest first
            if budget > 0 and seq.status == RUNNING:
                chunks.append(self._chunk(seq, budget))
                budget -= chunks[-1].length
        while (not preempted and budget > 0 and self.waiting
               and len(self.running) < self.max_num_seqs and self._admit(self.waiting[0])):
            chunks.append(self._chunk(self.waiting.popleft(), budget))
            budget -= chunks[-1].length
        # Later steps may share the pages these chunks fill: the device runs steps in order,
        # so their K/V are written before any later step reads them. A decode row's known
        # tokens grow by one a step, so it fills a page only when they reach a page boundary.
        cache, span = self.pages.cache_full_pages, self.pages.page_size
        for i, (seq, start, length, _) in enumerate(chunks):
            if i >= decoded or len(seq.tokens) % span == 0:
                cache(seq.request_id, seq.tokens, start + length)
        return chunks

    def _decode(self) -> tuple[list[Chunk], list[Sequence], bool]:
        """One token for every running sequence whose next token is its last known one, oldest
        first; the pool grows (or preempts the newest) only when a page fills up. Returns the
        chunks, the running sequences with a prefill under way, and whether it preempted (then
        nothing new is admitted this step)."""
        chunks, prefilling, before = [], [], self.num_preemptions
        tables, span = self.pages.tables, self.pages.page_size
        for seq in list(self.running):
            start, total = seq.num_computed, len(seq.tokens) + seq.num_pending
            if total - start != 1:
                if total - start > 1:
                    prefilling.append(seq)
                continue
            if seq.status != RUNNING or total - len(seq.prompt_ids) >= seq.max_output:
                continue  # preempted, or its pending token is its last (it ends on arrival)
            if total > len(tables[seq.request_id]) * span and not self._grow(seq, total):
                continue
            seq.num_computed, seq.num_pending = total, seq.num_pending + 1
            chunks.append(_new_chunk(Chunk, (seq, start, 1, True)))
        return chunks, prefilling, self.num_preemptions != before

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
        return True

    def _chunk(self, seq: Sequence, budget: int) -> Chunk:
        n = min(seq.total_len - seq.num_computed, budget)
        chunk = Chunk(seq, seq.num_computed, n, seq.num_computed + n == seq.total_len)
        seq.num_computed += n
        seq.num_pending += chunk.samples  # its sample reaches the host a step later
        return chunk

    def _admit(self, seq: Sequence) -> bool:
        """Running state with cached prefix pages and pages for every known token, or nothing.
        A sequence whose last sampled token is still on its way waits for it."""
        if seq.num_pending:
            return False
        pages, tokens = self.pages, seq.tokens
        hit = pages.share_prefix(seq.request_id, tokens[:-1])  # leave 1 token to compute
        # Keep a page per running sequence in reserve so admission does not force preemption.
        reserve = len(self.running) + 1 if self.running else 0
        need = pages.pages_for(len(tokens)) - len(pages.table(seq.request_id))
        if need + reserve > pages.num_available() or not pages.grow(seq.request_id, len(tokens)):
            pages.free(seq.request_id)
            return False
        if not seq.ever_admitted:
            seq.cached_tokens, seq.ever_admitted = hit, True
        self.prefix_hit_tokens += hit
        seq.num_computed, seq.status, seq.slot = hit, RUNNING, self.free_slots.pop()
        table = pages.table(seq.request_id)
        self.page_table[seq.slot, :len(table)] = table
        self.page_table[seq.slot, len(table):] = 0
        self.running.append(seq)
        self.admitted.append(seq)
        return True

    def stats(self) -> dict:
        return dict(running=len(self.running), waiting=len(self.waiting),
                    prefix_hit_tokens=self.prefix_hit_tokens, preemptions=self.num_preemptions)
