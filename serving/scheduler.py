"""The step scheduler: continuous batching with chunked prefill, prefix reuse and preemption.

Each step has a token budget and a sequence limit. Running sequences in decode get their one
token first; the rest of the budget goes to prefill chunks, oldest request first. A sequence
always computes `tokens[num_computed:]`; once everything it has is computed, the step samples
its next token. That single rule covers prefill, decode and recompute after preemption.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from .kv_pages import OutOfPages, PagePool, page_hashes


class RequestError(ValueError):
    """A request that cannot be served as asked; the message names the limit."""


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: object
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_token_time: float | None = None
    admitted_once: bool = False
    fresh: bool = True  # its sampler state must be reset at its next scheduled step
    slot: int = -1  # row of the sampler's per-sequence state while running

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


@dataclasses.dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index of the chunk within seq.tokens
    length: int
    samples: bool  # the chunk reaches the end of the sequence's tokens: sample after it


class Scheduler:
    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.pool, self.max_num_seqs, self.max_model_len = pool, max_num_seqs, max_model_len
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.prefix_hit_tokens = 0

    # -- requests -----------------------------------------------------------------------------
    def add(self, seq: Sequence):
        limit = self.max_model_len
        need = len(seq.prompt_ids) + max(1, getattr(seq.sampling, "max_tokens", 1) or 1)
        if not seq.prompt_ids:
            raise RequestError("prompt is empty: it needs at least 1 token")
        if len(seq.prompt_ids) >= limit:
            raise RequestError(f"prompt has {len(seq.prompt_ids)} tokens; the context limit "
                               f"(max_model_len) is {limit}, which leaves no room to generate")
        if need > limit:
            raise RequestError(f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens "
                               f"({need - len(seq.prompt_ids)}) = {need} exceeds the context "
                               f"limit (max_model_len) of {limit} tokens")
        pages = -(-need // self.pool.page_size)
        if pages > self.pool.num_pages:
            raise RequestError(f"the request needs {pages} KV pages of {self.pool.page_size} "
                               f"tokens but the pool holds only {self.pool.num_pages}")
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        return None

    def finish(self, seq: Sequence):
        """Release a running sequence's pages and its slot."""
        self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence):
        for page in seq.pages:
            self.pool.release(page)
        seq.pages = []
        seq.num_computed = 0
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- pages --------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` pages for `num_tokens` tokens; False (and no change) if the pool is dry."""
        need = -(-num_tokens // self.pool.page_size) - len(seq.pages)
        if need > self.pool.available():
            return False
        seq.pages += [self.pool.allocate() for _ in range(need)]
        return True

    def _preempt_newest(self, keep: Sequence) -> bool:
        """Free the newest running sequence other than `keep` (it is recomputed later)."""
        for victim in reversed(self.running):
            if victim is not keep:
                self.running.remove(victim)
                self._release(victim)
                victim.fresh = True
                self.waiting.appendleft(victim)
                return True
        return False

    def register_full_pages(self, seq: Sequence):
        """Offer pages whose every token is computed to the prefix cache."""
        full = seq.num_computed // self.pool.page_size
        tokens = seq.tokens
        for page, h in zip(seq.pages[:full], page_hashes(tokens[:full * self.pool.page_size],
                                                            self.pool.page_size, self.pool.model_key)):
            self.pool.register(page, h)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        chunks, budget = [], self.budget
        for seq in list(self.running):  # decode first, oldest first
            if seq.remaining != 1 or seq not in self.running:
                continue
            while not self._grow(seq, seq.num_computed + 1):
                if not self._preempt_newest(keep=seq):
                    raise OutOfPages("a single sequence needs more KV pages than the pool has")
            if seq in self.running:
                chunks.append(ScheduledChunk(seq, seq.num_computed, 1, True))
                budget -= 1
        chunks = [c for c in chunks if c.seq in self.running]  # drop chunks of preempted seqs
        budget = self.budget - len(chunks)
        for seq in self.running:  # prefills already under way
            if budget > 0 and seq.remaining > 1:
                chunks.append(self._chunk(seq, budget))
                budget -= chunks[-1].length
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].length
        return chunks

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        n = min(seq.remaining, budget)
        return ScheduledChunk(seq, seq.num_computed, n, n == seq.remaining)

    def _admit(self, seq: Sequence) -> bool:
        """Take cached prefix pages and pages for every remaining token, or nothing at all."""
        tokens = seq.tokens
        # Keep at least one token to compute, so the step yields logits to sample from.
        hashes = page_hashes(tokens[:len(tokens) - 1], self.pool.page_size, self.pool.model_key)
        pages = self.pool.match_prefix(hashes)
        seq.pages, seq.num_computed = pages, len(pages) * self.pool.page_size
        if not self._grow(seq, len(tokens)):
            for page in pages:
                self.pool.release(page)
            seq.pages, seq.num_computed = [], 0
            return False
        if not seq.admitted_once:
            seq.cached_tokens = seq.num_computed
            seq.admitted_once = True
        self.prefix_hit_tokens += seq.num_computed
        seq.slot = self.free_slots.pop()
        return True

    def advance(self, chunk: ScheduledChunk):
        """Mark a chunk computed (after the step ran)."""
        chunk.seq.num_computed = chunk.start + chunk.length
        chunk.seq.fresh = False
        self.register_full_pages(chunk.seq)
