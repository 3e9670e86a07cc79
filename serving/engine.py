"""The engine: schedule, pad to a bucket, run one jitted step (forward + sampling), hand out
each request's new tokens, text and finish reason.

Shapes are bucketed: the token axis T takes a power of two up to the step's token budget, the
sequence axis min(T, max_num_seqs), the page table a fixed width. `warmup()` compiles every
bucket, so a user's request never waits for a compilation.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..model import Batch, forward, init_kv_cache
from . import sampling as S
from .kv_pages import PagePool
from .scheduler import RequestError, ScheduledChunk, Scheduler, Sequence

_compilations = 0


def _count_compile(event, *args, **kwargs):
    global _compilations
    if event == "/jax/core/compile/backend_compile_duration":
        _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compilations() -> int:
    """XLA compilations so far in this process."""
    return _compilations


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    logprobs: list | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    arrival_time: float
    first_token_time: float | None


def _buckets(limit: int, smallest: int = 8) -> list[int]:
    out, b = [], smallest
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


class Engine:
    def __init__(self, config, params, tokenizer=None, *, num_pages: int, page_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_model_len: int | None = None, mesh=None, cache_dtype=None):
        self.config, self.params, self.tokenizer, self.mesh = config, params, tokenizer, mesh
        self.max_model_len = min(max_model_len or config.max_position_embeddings,
                                 num_pages * page_size)
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size, model_key=repr(config))
        self.scheduler = Scheduler(self.pool, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=self.max_model_len)
        self.max_num_seqs = max_num_seqs
        self.token_buckets = _buckets(max_num_batched_tokens)
        self.history_buckets = _buckets(self.max_model_len)
        self.pages_per_seq = -(-self.max_model_len // page_size)
        dtype = cache_dtype or jax.tree.leaves(params)[0].dtype
        self.kv_cache = init_kv_cache(config, num_pages, page_size, dtype)
        self.penalties = S.init_state(max_num_seqs, config.vocab_size)
        self._step_fn = jax.jit(self._device_step, donate_argnums=(1, 2))
        self._reset_fn = jax.jit(S.reset_row, donate_argnums=0)
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # aborts reported at the next step
        self._rng = np.random.default_rng()
        self.compilations = 0  # XLA compilations inside warmup() and step()
        self.warm_compilations, self.warmed = 0, False

    # -- the jitted step ----------------------------------------------------------------------
    def _device_step(self, params, kv_cache, penalties, tokens, positions, batch, token_rows,
                     token_is_output, seq_rows, sampling):
        penalties = S.record_tokens(penalties, token_rows, tokens, token_is_output)
        logits, kv_cache = forward(params, self.config, tokens, positions, kv_cache, batch)
        return S.sample(logits, penalties, seq_rows, sampling), kv_cache, penalties

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], sampling: S.SamplingParams):
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary "
                               f"[0, {self.config.vocab_size})")
        seq = Sequence(request_id, list(prompt_ids), sampling)
        seq.seed = sampling.seed if sampling.seed is not None else int(self._rng.integers(2**31))
        seq.detok = self._detokenizer(seq.prompt_ids)
        seq.text, seq.sent = "", 0
        self.scheduler.add(seq)
        self._seqs[request_id] = seq

    def _detokenizer(self, prompt_ids):
        if self.tokenizer is None:
            return None
        from ..model.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids)

    def abort(self, request_id: str):
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(request_id)
            self._pending.append(self._output(seq, [], "", None, "abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def stats(self) -> dict:
        return {**self.pool.stats(), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
                "compilations": self.compilations, "compilations_after_warmup":
                self.compilations - self.warm_compilations if self.warmed else None}

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        before = compilations()
        try:
            return self._step()
        finally:
            self.compilations += compilations() - before

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        for c in chunks:
            if c.seq.fresh:
                self._load_history(c.seq)
        arrays = self._pack(chunks)
        (tokens, chosen, top_ids, top_lp), self.kv_cache, self.penalties = self._step_fn(
            self.params, self.kv_cache, self.penalties, *arrays)
        tokens, chosen, top_ids, top_lp = jax.device_get((tokens, chosen, top_ids, top_lp))
        now = time.monotonic()
        for i, c in enumerate(chunks):
            self.scheduler.advance(c)
            if c.samples:
                outputs.append(self._accept(c.seq, int(tokens[i]), float(chosen[i]),
                                            top_ids[i], top_lp[i], now))
        return outputs

    def _load_history(self, seq: Sequence):
        """Reset the sequence's penalty row and load the tokens it will not feed (cached)."""
        done = seq.tokens[:seq.num_computed]
        size = next(b for b in self.history_buckets if b >= max(len(done), 1))
        ids = np.zeros(size, np.int32)
        ids[:len(done)] = done
        is_output = np.arange(size) >= len(seq.prompt_ids)
        valid = np.arange(size) < len(done)
        self.penalties = self._reset_fn(self.penalties, np.int32(seq.slot), ids, is_output, valid)

    def _pack(self, chunks: list[ScheduledChunk]):
        """Lay the chunks out on one flat token axis, padded to a bucket."""
        n = sum(c.length for c in chunks)
        T = next(b for b in self.token_buckets if b >= n)
        Sb = min(T, self.max_num_seqs)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        token_rows = np.full(T, -1, np.int32)
        is_output = np.zeros(T, bool)
        query_start = np.zeros(Sb + 1, np.int32)
        context = np.zeros(Sb, np.int32)
        table = np.zeros((Sb, self.pages_per_seq), np.int32)
        last = np.zeros(Sb, np.int32)
        seq_rows = np.full(Sb, -1, np.int32)
        at = 0
        for i, c in enumerate(chunks):
            seq, end = c.seq, c.start + c.length
            pos = np.arange(c.start, end)
            pages = np.asarray(seq.pages, np.int32)
            tokens[at:at + c.length] = seq.tokens[c.start:end]
            positions[at:at + c.length] = pos
            slots[at:at + c.length] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
            token_rows[at:at + c.length] = seq.slot
            is_output[at:at + c.length] = pos >= len(seq.prompt_ids)
            table[i, :len(pages)] = pages
            context[i], last[i], seq_rows[i] = end, at + c.length - 1, seq.slot
            at += c.length
            query_start[i + 1:] = at
        sampling = S.SamplingBatch.from_params(
            [c.seq.sampling for c in chunks], [c.seq.seed for c in chunks],
            [len(c.seq.output_ids) for c in chunks], Sb)
        batch = Batch(query_start, context, table, slots, last)
        return tokens, positions, batch, token_rows, is_output, seq_rows, sampling

    # -- results ------------------------------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, logprob: float, top_ids, top_lp, now):
        sp = seq.sampling
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        lps = None
        if sp.logprobs is not None:
            lps = [{"token_id": token, "logprob": logprob,
                    "top": [(int(t), float(l)) for t, l in zip(top_ids[:sp.logprobs], top_lp[:sp.logprobs])]}]
        reason = None
        eos = () if sp.ignore_eos or self.tokenizer is None else self.tokenizer.eos_token_ids
        eos = set(eos) | set(() if sp.ignore_eos else self.config.eos_token_ids)
        if token in eos or token in sp.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= sp.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if seq.detok is not None and reason != "stop":  # stop tokens add no text
            seq.text += seq.detok.add(token)
        delta, stopped = self._text_delta(seq, final=reason is not None)
        if stopped:
            reason = "stop"
        if reason is not None:
            self._seqs.pop(seq.request_id, None)
            if seq in self.scheduler.running:
                self.scheduler.finish(seq)
        return self._output(seq, [token], delta, lps, reason)

    def _text_delta(self, seq: Sequence, final: bool):
        """New text to send; holds back a tail that could still become a stop string."""
        stops = seq.sampling.stop
        if stops:
            for s in stops:
                at = seq.text.find(s, max(0, seq.sent - len(s)))
                if at >= 0:
                    seq.text = seq.text[:at]
                    delta, seq.sent = seq.text[seq.sent:], len(seq.text)
                    return delta, True
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        upto = max(seq.sent, len(seq.text) - hold)
        delta, seq.sent = seq.text[seq.sent:upto], upto
        return delta, False

    def _output(self, seq, tokens, delta, lps, reason):
        return RequestOutput(seq.request_id, tokens, delta, lps, reason is not None, reason,
                             len(seq.prompt_ids), seq.cached_tokens, len(seq.output_ids),
                             seq.arrival_time, seq.first_token_time)

    # -- warm-up ------------------------------------------------------------------------------
    def warmup(self):
        """Compile every bucket now, on all-padding batches that touch no real page or row."""
        before = compilations()
        for T in self.token_buckets:
            Sb = min(T, self.max_num_seqs)
            batch = Batch(np.zeros(Sb + 1, np.int32), np.zeros(Sb, np.int32),
                          np.zeros((Sb, self.pages_per_seq), np.int32), np.full(T, -1, np.int32),
                          np.zeros(Sb, np.int32))
            sampling = S.SamplingBatch.from_params([], [], [], Sb)
            (tok, *_), self.kv_cache, self.penalties = self._step_fn(
                self.params, self.kv_cache, self.penalties, np.zeros(T, np.int32),
                np.zeros(T, np.int32), batch, np.full(T, -1, np.int32), np.zeros(T, bool),
                np.full(Sb, -1, np.int32), sampling)
            tok.block_until_ready()
        for size in self.history_buckets:
            self.penalties = self._reset_fn(self.penalties, np.int32(0), np.zeros(size, np.int32),
                                            np.zeros(size, bool), np.zeros(size, bool))
        jax.block_until_ready(self.penalties)
        self.compilations += compilations() - before
        self.warm_compilations, self.warmed = self.compilations, True
