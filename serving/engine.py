"""The engine: schedule a step, pad it to a bucket, run one compiled step (forward + sampling)
with the device state donated, and hand each request its tokens and finish reason (and its text
where stop strings need it; `detokenize.py` makes the rest).

Shapes come from a small set of buckets: the token axis T, the sequence axis S = min(T,
max_num_seqs) and the page-table width P. `warmup()` compiles every reachable (T, P) pair ahead
of time, so no request ever waits for a compilation, and `compilations` counts them all.

The host runs one step ahead of the device: `step()` dispatches step n+1 and only then waits for
step n's tokens, so scheduling and packing overlap the device's work. A sequence decoding on a
token the host has not seen yet reads it from `last_tokens`, a device array holding each slot's
latest sample.

The host path of a step, in order (each a method below; hooks go beside the one they extend):
  `Scheduler.schedule_step` picks the rows (decode rows first, then prefill chunks) as arrays;
  `_admit_rows`         writes newly admitted sequences' constant rows into the batch state;
  `BatchState.pack`     gathers the step's arrays from the slot-indexed batch state (batch.py);
  `_dispatch`           runs the compiled forward pass and sampler, donating the device state
                        (or has the launch thread run them beside `_collect`: launcher.py);
  `_collect`            reads step n-1's samples back and `_accept`s them in bulk: tokens and
                        finish reasons as arrays over the rows, then the outputs, built
                        column by column. Their text is made after the step (detokenize.py),
                        except where a stop string must be found in it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from concurrent.futures import Future
from functools import partial
from itertools import compress, repeat
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import tuning
from ..model import Batch, forward, init_kv_cache, quant, quant_int
from ..model.tokenizer import IncrementalDetokenizer
from . import sampling
from .batch import LOGPROBS, BatchState, int_layout, sample_layout
from .structured import Guide, guided_layout
from .kv_pages import KVPages
from .kv_window import freeable_window
from .launcher import Launcher
from .scheduler import FINISHED, RequestError, Scheduler, Sequence
from .settings import compiler_options, default_launch_thread
from .speculative import SpeculativeConfig, make_speculator
from .warmup import default_page_buckets, warm_up

HISTORY_CHUNK = 256  # tokens per call when loading a penalized sequence's history
# XLA:GPU rewrites the product of a single row with a small matrix (under 10M elements, such as
# the k and v projections) into a multiply and a reduction that stream the weights at a quarter
# of HBM speed (profiling/profile_step.py, docs/BENCHMARKS.md); with two rows it stays a matrix
# product. So the token axis is never shorter than two slots, unless every projection is one of
# the quantized kernels, which read a lone row faster than two (`min_token_bucket`).
MIN_TOKEN_BUCKET = 2
# Steps of up to this many logits rows write them over the last such step's (`Engine._forward`):
# where the host's launch shows. Larger steps take a new buffer (their sizes' buffers kept
# would add up to twice the largest, out of the memory left for activations).
KEPT_LOGITS_ROWS = 128


def min_token_bucket(params) -> int:
    return 1 if quant.all_linear_quantized(params) else MIN_TOKEN_BUCKET


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely (token id, logprob), best first


class RequestOutput(NamedTuple):
    """What a request got from one step (a tuple: the engine makes one per running request per
    step)."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str | None  # None: the text is left to a TextStage (detokenize.py)
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # None, "stop", "length" or "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    arrival_time: float
    first_token_time: float | None
    spec_proposed: int = 0  # speculative tokens proposed for this request so far
    spec_accepted: int = 0  # ... and accepted
    stop_reason: int | str | None = None  # the stop token (its text left out) or stop string


_new_output = tuple.__new__


def geometric(limit: int, factor: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= factor
    return out + [limit]


class Engine:
    def __init__(self, config, params, tokenizer=None, *, num_pages: int, page_size: int = 16,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None = None,
                 mesh=None, token_buckets=None, page_buckets=None, overlap: bool = True,
                 seed: int = 0, kv_cache_dtype=None, speculative_config=None, draft=None,
                 batch_invariant: bool | str | None = None, pace: int | None = None,
                 launch_thread: bool | None = None):
        if batch_invariant is True and mesh is not None and mesh.devices.size > 1:
            # XLA partitions the products over the mesh; the invariant kernel is one device's.
            raise ValueError("batch_invariant=True runs on one device, not on a mesh")
        self.config, self.params, self.tokenizer, self.overlap = config, params, tokenizer, overlap
        # The KV pages' dtype (None: the weights'); float8 pages carry per-KV-head scales.
        self.kv_cache_dtype = jnp.dtype(kv_cache_dtype or jax.tree.leaves(params)[0].dtype)
        self.page_size, self.max_num_seqs = page_size, max_num_seqs
        self.max_model_len = max_model_len or min(config.max_position_embeddings,
                                                  num_pages * page_size)
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({config.max_position_embeddings})")
        self.pages = KVPages(num_pages, page_size, model_key=repr(config))
        self.scheduler = Scheduler(self.pages, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=self.max_model_len, pace=pace)
        max_pages = self.pages.pages_for(self.max_model_len)
        spec = SpeculativeConfig.parse(speculative_config)
        least = min_token_bucket(params)
        self.token_buckets = sorted({max(least, b) for b in token_buckets or (
            geometric(max_num_batched_tokens, 4) + [max_num_seqs]
            + ([spec.num_speculative_tokens + 1] if spec else []))})
        self.page_buckets = sorted(set(page_buckets or default_page_buckets(max_pages)))
        if self.token_buckets[-1] < max_num_batched_tokens or self.page_buckets[-1] < max_pages:
            raise ValueError(f"buckets must reach max_num_batched_tokens ({max_num_batched_tokens})"
                             f" and the pages of max_model_len ({max_pages})")
        self.batch = BatchState(max_num_seqs, page_size, self.scheduler.page_table,
                                self.token_buckets, self.page_buckets)
        self._place(mesh, num_pages)
        # Speculation: proposals follow the previous step's tokens, so its steps do not overlap.
        self.spec = make_speculator(spec, target_config=config, params_dtype=self.params[
            "embed"].dtype, pages=self.pages, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, token_buckets=self.token_buckets,
            page_buckets=self.page_buckets, draft=draft)
        self.rows = self.spec.rows if self.spec else 1
        # `tuning.batch_invariant`: True sums each row's products and attention in an order the
        # rest of the batch does not change (speculation's greedy tokens are then plain
        # decoding's, at a cost); by default a speculating engine fixes only the attention's
        # key splits, which costs nothing.
        self.batch_invariant = batch_invariant if batch_invariant is not None else (
            "attention" if self.spec is not None else False)
        self.scheduler.window = freeable_window(config, self.spec)  # pages behind every window
        if self.spec:
            self.overlap = False
            self.spec.install(self.scheduler, self.batch)
        self.eos = set(config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.guide = Guide(tokenizer, config.vocab_size, self.eos)  # structured output, logit bias
        self._guided: set[str] = set()  # live requests the guide constrains or biases
        self._stopping: set[str] = set()  # live requests with stop strings: text made here
        self.seqs: dict[str, Sequence] = {}
        self._outbox: list[RequestOutput] = []  # abort notices for the next step()
        self._stop_set, self._stop_any = set(), np.zeros(0, np.int64)  # every stop token id
        self._inflight = None  # (rows, device output, ...) of the step not yet read back
        self._early = ([], 0.0)  # its outputs and wait, when read back inside _launch
        self._exe: dict = {}  # (T, P) -> compiled forward pass
        self._logits: dict = {}  # S -> the last logits of S rows, donated to the next such step
        self._samplers: dict = {}  # (S, mode) or (S, mode, "guided") -> compiled sampler
        self._load = None  # compiled history loader
        self.compilations = 0
        self._rng = random.Random(seed)
        self.totals = dict(steps=0, host_s=0.0, wait_s=0.0)
        self.step_log: list[dict] | None = None  # set to [] to record every step (benchmarks)
        # Steps a step ahead may launch on a thread of their own (launcher.py).
        if launch_thread is None:
            launch_thread = default_launch_thread()
        self._launcher = Launcher() if launch_thread else None

    def _place(self, mesh, num_pages: int):
        """The device state: KV pages, the last sample of each slot (+ a scratch slot) and the
        penalties' history. On a mesh, params and pages go on their shards, the rest is
        replicated, and the step follows those shardings."""
        config, dtype = self.config, self.kv_cache_dtype
        last_tokens = jnp.zeros(self.max_num_seqs + 1, jnp.int32)
        history = sampling.init_history(self.max_num_seqs, config.vocab_size)
        self._jit, self._inputs = jax.jit, None
        if mesh is None:
            self.params = quant_int.for_kernels(self.params)  # packed weights as read fastest
            kv = init_kv_cache(config, num_pages, self.page_size, dtype)
        else:
            from ..sharding import Layout
            layout = Layout(config, mesh, serving=True)
            self.params, self._jit, self._inputs = (layout.place_params(self.params), layout.jit,
                                                    layout.replicated)
            kv = layout.init_kv_cache(num_pages, self.page_size, dtype)
            last_tokens, history = layout.replicate((last_tokens, history))
        self.state = (kv, last_tokens, history)

    # -- requests -----------------------------------------------------------------------------
    def check_request(self, prompt_ids, sampling_params):
        """Raise RequestError if the request cannot be served (read-only: safe from any thread)."""
        self.scheduler.check(prompt_ids)
        V = self.config.vocab_size  # the prompt is not empty (checked above)
        bad = [] if 0 <= min(prompt_ids) and max(prompt_ids) < V else [
            t for t in prompt_ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary "
                               f"(vocab_size {V})")
        bad = [t for t in sampling_params.stop_token_ids or () if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"stop token id {bad[0]} is outside the vocabulary "
                               f"(vocab_size {self.config.vocab_size})")
        try:
            self.guide.check(sampling_params)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def add_request(self, request_id: str, prompt_ids: list[int], sampling_params,
                    quiet: bool = False):
        """Queue a request. `quiet`: step() makes two outputs for it, its first token and, as it
        ends, the rest of its tokens (as `LLM.generate` and the servers' unary calls want them:
        a step then builds no output for each running request). Asking for logprobs or stop
        strings (whose text comes a step at a time) takes every output."""
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_ids, sampling_params)
        sp = sampling_params
        seq = Sequence(request_id, prompt_ids, sp,
                       seed=self._rng.getrandbits(32) if sp.seed is None else sp.seed % 2**32)
        seq.max_output = min(sp.max_tokens or self.max_model_len, self.max_model_len - len(prompt_ids))
        seq.stop_ids = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else self.eos)
        if not seq.stop_ids <= self._stop_set:  # candidates for the stop test of _accept
            self._stop_set |= seq.stop_ids
            self._stop_any = np.array(sorted(self._stop_set), np.int64)
        seq.quiet = quiet and sp.logprobs is None and not sp.stop
        seq.penalized = (sp.repetition_penalty != 1 or sp.presence_penalty != 0
                         or sp.frequency_penalty != 0)
        seq.mode = sampling.mode_of(sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                    seq.penalized, sp.logprobs is not None)
        row = dict(temperature=sp.temperature, top_p=sp.top_p, min_p=sp.min_p,
                   repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                   frequency_penalty=sp.frequency_penalty, top_k=sp.top_k, seed=seq.seed,
                   logprobs=-1 if sp.logprobs is None else sp.logprobs)
        seq.row = sampling.pack_rows([row], 1)
        self.guide.start(seq)
        if Guide.guided(seq):
            self._guided.add(request_id)
        if self.tokenizer is not None and sp.stop:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids)
            self._stopping.add(request_id)
        self.scheduler.add(seq)
        self.seqs[request_id] = seq

    def abort(self, request_id: str):
        """Stop a request in any state; its pages are freed now, the notice comes from step()."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._finish(seq)
            held = seq.output_ids[1:] if seq.quiet else []  # its first token went out
            self._outbox.append(self._output(seq, held, "", None, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self.seqs or self._outbox)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so that later prompts are computed whole (a clean
        state for measurements). Only when idle; False, and nothing changed, otherwise."""
        if self.has_unfinished() or self._inflight:
            return False
        self.pages.reset_cache()
        return True

    def stats(self) -> dict:
        steps = max(self.totals["steps"], 1)
        return {**self.pages.stats(), **self.scheduler.stats(), "compilations": self.compilations,
                **(self.spec.stats() if self.spec else {}),
                "steps": self.totals["steps"],
                "host_ms_per_step": 1e3 * self.totals["host_s"] / steps,
                "wait_ms_per_step": 1e3 * self.totals["wait_s"] / steps}

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Dispatch the next step, then collect the previous one's results."""
        t0 = time.perf_counter()
        self._join_launch()
        outputs, self._outbox = self._outbox, []
        if self.spec:
            self.spec.plan(self.scheduler.running, self.scheduler.budget - len(
                self.scheduler.running), self.max_model_len, skip=self.guide.guided)
        rows = self.scheduler.schedule_step()  # a Step; speculation works on its Chunks
        if self.spec and len(rows):
            rows = rows.chunks()
            self.spec.propose(rows, self.scheduler.admitted)
        launched = self._launch(rows) if len(rows) else None
        early, wait = self._early  # the previous step, if a guided sampler read it back
        outputs, self._early = outputs + early, ([], 0.0)
        for done in ([self._inflight] if self._inflight else []) + (
                [launched] if launched and not self.overlap else []):
            out, wait_s = self._collect(*done)
            outputs += out
            wait += wait_s
        self._inflight = launched if self.overlap else None
        if len(rows):
            host = time.perf_counter() - t0 - wait
            self.totals["steps"] += 1
            self.totals["wait_s"] += wait
            self.totals["host_s"] += host
            if launched[2] is not None:  # the step log: this call's host time and device wait
                launched[2].update(host_s=host, wait_s=wait)
        return outputs

    def _launch(self, rows):
        """Pack and launch a step; its device output, or a Future of it where the launch thread
        runs the call while `step` collects the step before and the caller takes the outputs
        (not while a guided sampler may read that step back inside `_dispatch`)."""
        released = self.scheduler.released.copy()  # before _dispatch, which may collect early
        self._admit_rows()
        packed = self.batch.pack(rows)
        entry = None
        if self.step_log is not None:
            entry = dict(self.batch.describe(packed), running=len(self.scheduler.running),
                         pages_used=self.pages.stats()["pages_used"])
            self.step_log.append(entry)
        guided = bool(self._guided)  # read here: requests come and go while the thread runs
        if self._launcher and self.overlap and not guided:
            return rows, self._launcher.submit(self._dispatch, packed, rows), entry, released
        return rows, self._dispatch(packed, rows, guided), entry, released

    def _join_launch(self):
        """Wait for the step the launch thread is launching (raising its error, if any)."""
        if self._inflight and isinstance(self._inflight[1], Future):
            rows, pending, *rest = self._inflight
            self._inflight = None  # a launch that failed leaves nothing in flight
            self._inflight = (rows, pending.result(), *rest)

    def _admit_rows(self):
        for seq in self.scheduler.admitted:
            self.batch.admit(seq)
            if seq.penalized:
                self._load_history(seq)

    def _dispatch(self, packed, chunks, guided: bool = False):
        """Run one step on the device (asynchronously); returns the samples' device array.
        `guided`: a live request is constrained or biased."""
        exe = self._exe.get(packed.key) or self._compile_now(packed.key)
        S = min(packed.key[0], self.max_num_seqs) * self.rows
        kv, last_tokens, history = self.state
        logits, kv = self._forward(exe, kv, last_tokens, packed.ints, S)
        ints, floats, skey = packed.sample_ints, packed.floats, (S, packed.mode)
        if guided:
            ints, floats, skey = self._guide_inputs(chunks, S, ints, floats, skey)
        sampler = self._samplers.get(skey) or self._compile_sampler(*skey)
        out, last_tokens, history = sampler(logits, last_tokens, history, ints, floats)
        out.copy_to_host_async()  # queued behind this step, not behind the next one
        self.state = (kv, last_tokens, history)
        return out

    def _forward(self, exe, kv, last_tokens, ints, S: int):
        """Run a compiled forward pass of S logits rows. A small step writes its logits over
        those of the last step of its size (donated): on the GPU its CUDA graph then finds its
        output where it was, and is launched as recorded instead of being updated first."""
        if S > KEPT_LOGITS_ROWS:
            return exe(self.params, kv, last_tokens, ints)
        self.make_logits([S])  # only if a failed step took this size's buffer with it
        logits, kv = exe(self.params, kv, last_tokens, ints, self._logits.pop(S))
        self._logits[S] = logits
        return logits, kv

    def make_logits(self, sizes):
        """A logits buffer [S, V] for each small row count S in `sizes` that has none (warm-up
        makes every step's, so that making one compiles nothing later)."""
        for S in sizes:
            if S <= KEPT_LOGITS_ROWS and S not in self._logits:
                self._logits[S] = jnp.zeros((S, self.config.vocab_size), jnp.float32,
                                            device=self._inputs)

    def _guide_inputs(self, chunks, S: int, ints, floats, skey):
        """Structured output and logit bias: the guided sampler variant and its extra inputs."""
        chunks = chunks if isinstance(chunks, list) else chunks.chunks()
        if self._inflight and self.guide.needs_sync(chunks):
            # A constrained row's mask needs the token of the step in flight: read it back now,
            # while this step's forward pass runs; only the sampler waits for the mask.
            self._early = self._collect(*self._inflight)
            self._inflight = None
        guided = self.guide.step_inputs(self.spec.spread(chunks) if self.spec else chunks, S)
        if guided is None:
            return ints, floats, skey
        return (np.concatenate([ints, guided[0]]), np.concatenate([floats, guided[1]]),
                skey + ("guided",))

    def _collect(self, rows, out, entry, released):
        """Read a step's samples back (waiting for the device) and accept them. `released`: each
        slot's release count when it was launched; rows of sequences finished since are skipped."""
        t = time.perf_counter()
        out = np.asarray(out)  # waits for the device (for step n, while step n+1 is queued)
        done = time.perf_counter()
        if entry is not None:
            entry["done"] = done
        if self.spec:
            return self.spec.collect(self, rows, out), done - t
        # A row whose slot was given back since launch: skipped if its sequence finished (one
        # preempted still takes its token).
        live, now = rows.samples.copy(), self.scheduler.released
        for i in np.flatnonzero(now[rows.slots] != released[rows.slots]).tolist():
            live[i] &= rows.seqs[i].status != FINISHED
        idx = np.flatnonzero(live)
        seqs = rows.seqs if len(idx) == len(rows) else [rows.seqs[i] for i in idx.tolist()]
        # Slots as at launch: a row's slot is not handed to another sequence before its step is
        # collected (a freed slot is reused only by a finished sequence's row, skipped here, as
        # no admission follows a preemption in the same step).
        n_tokens = rows.start[idx] + rows.length[idx] + 1
        return self._accept(seqs, out[idx], rows.slots[idx], n_tokens), done - t

    # -- host side of a step ------------------------------------------------------------------
    def _accept(self, seqs: list[Sequence], out: np.ndarray, slots=None, n_tokens=None
                ) -> list[RequestOutput]:
        """Take one sampled token per sequence: tokens and finish reasons as arrays over the
        rows (Python only for stop-token candidates, first tokens, guided rows, logprobs and
        finishes), then the new text of those with stop strings in one batched detokenization
        (the others' is a TextStage's), then the outputs (for a `quiet` request, only its
        first and last). `slots`, `n_tokens` (the token count after this one): known to the
        caller, or read off the sequences."""
        now, n, batch = time.time(), len(seqs), self.batch
        tokens = out[:, 0]
        toks = tokens.tolist()
        for seq, token in zip(seqs, toks):
            seq.tokens.append(token)
        if slots is None:
            slots = np.fromiter((s.slot for s in seqs), np.int64, n)
            n_tokens = np.fromiter((len(s.tokens) for s in seqs), np.int64, n)
        # One token each has arrived: a running sequence's count is its slot's; one preempted
        # since the step's launch holds its own.
        sched = self.scheduler
        held = (slots >= 0) & sched.live[np.maximum(slots, 0)]
        sched.pending[slots[held]] -= 1
        for i in np.flatnonzero(~held).tolist():
            seqs[i].num_pending -= 1
        plen = batch.prompt_len[slots]
        reasons = np.where(n_tokens >= self.scheduler.limit[slots], "length", None)
        why = [None] * n
        for i in np.flatnonzero(np.isin(tokens, self._stop_any)).tolist():
            if toks[i] in seqs[i].stop_ids:
                reasons[i], why[i] = "stop", toks[i]
        for i in np.flatnonzero(n_tokens - plen == 1).tolist():
            seqs[i].first_token_time, batch.first_token[slots[i]] = now, now
        complete, guided = [], self._guided
        for i in [i for i, s in enumerate(seqs) if s.request_id in guided] if guided else ():
            if self.guide.accept(seqs[i], toks[i]):
                complete.append(i)
        deltas = repeat(None)
        if self._stopping:
            deltas = self._text(seqs, toks, reasons, complete, why)
        else:
            self._complete(reasons, complete)
        lps = [None] * n
        for i in np.flatnonzero(batch.ints[LOGPROBS, slots] >= 0).tolist():
            lps[i] = self._logprobs(seqs[i], toks[i], out[i])
        finished = np.not_equal(reasons, None)
        for seq in compress(seqs, finished.tolist()):
            self._finish(seq)
        quiet = None if self.spec else batch.quiet[slots]
        if quiet is None or not quiet.any():
            new_ids = [[t] for t in toks]
        else:  # quiet rows: an output for their first token, then none until the last, which
            # carries the rest (the speculative path, which merges an output a row for each
            # token it emits, takes them all)
            first = n_tokens - plen == 1
            keep = np.flatnonzero(~quiet | finished | first)
            rows = keep.tolist()
            new_ids = [seqs[i].output_ids[1:] if q and f and not one else [toks[i]]
                       for i, q, f, one in zip(rows, quiet[keep].tolist(),
                                               finished[keep].tolist(), first[keep].tolist())]
            slots, reasons, finished, plen, n_tokens = (
                a[keep] for a in (slots, reasons, finished, plen, n_tokens))
            deltas = [deltas[i] for i in rows] if self._stopping else deltas
            lps, why = [lps[i] for i in rows], [why[i] for i in rows]
        return list(map(_new_output, repeat(RequestOutput), zip(
            batch.request_id[slots].tolist(), new_ids, deltas, lps,
            finished.tolist(), reasons.tolist(), plen.tolist(),
            batch.cached[slots].tolist(), (n_tokens - plen).tolist(),
            batch.arrival[slots].tolist(), batch.first_token[slots].tolist(), repeat(0),
            repeat(0), why)))

    def _finish(self, seq: Sequence):
        self.seqs.pop(seq.request_id, None)
        self._guided.discard(seq.request_id)
        self._stopping.discard(seq.request_id)
        self.scheduler.finish(seq)

    def _text(self, seqs, tokens, reasons, complete, why) -> list[str | None]:
        """The text deltas of the sequences with stop strings, their new tokens detokenized in one
        batched call (a stop token adds no text); a stop string found in the text sets the
        reason to "stop" and is the row's `why`. The others' text is left to a TextStage."""
        deltas, stopping = [None] * len(seqs), self._stopping
        rows = [i for i, seq in enumerate(seqs) if seq.request_id in stopping]
        todo = [i for i in rows if reasons[i] != "stop"]
        for i, text in zip(todo, IncrementalDetokenizer.add_many(
                [seqs[i].detok for i in todo], [tokens[i] for i in todo])):
            deltas[i] = text
        self._complete(reasons, complete)  # a row the grammar ends is final: no text held back
        for i in rows:
            seqs[i].text += deltas[i] or ""
            deltas[i], hit = self._text_delta(seqs[i], final=reasons[i] is not None)
            if hit is not None:
                reasons[i], why[i] = "stop", hit
        return deltas

    @staticmethod
    def _complete(reasons, complete):
        for i in complete:  # the grammar admits nothing more: done, its text kept
            reasons[i] = reasons[i] or "stop"

    @staticmethod
    def _logprobs(seq: Sequence, token: int, row) -> list[TokenLogprob]:
        """row: token, logprob, top ids, top logprobs (floats bit-cast)."""
        n, width, f = seq.sampling.logprobs, (len(row) - 2) // 2, row.view(np.float32)
        top = zip(row[2:2 + n].tolist(), f[2 + width:2 + width + n].tolist())
        return [TokenLogprob(token, float(f[1]), list(top))]

    def _text_delta(self, seq: Sequence, final: bool) -> tuple[str, str | None]:
        """New text to send, and the stop string that ended it, if one did. While running, a tail
        that could still grow into a stop string is held back."""
        stops = seq.sampling.stop or ()
        for s in stops:
            at = seq.text.find(s, max(0, seq.sent - len(s) + 1))
            if at >= 0:
                seq.text = seq.text[:at]
                delta, seq.sent = seq.text[seq.sent:], len(seq.text)
                return delta, s
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        upto = max(seq.sent, len(seq.text) - hold)
        delta, seq.sent = seq.text[seq.sent:upto], upto
        return delta, None

    def _output(self, seq, tokens, delta, lps, reason) -> RequestOutput:
        return RequestOutput(seq.request_id, tokens, delta, lps, reason is not None, reason,
                             len(seq.prompt_ids), seq.cached_tokens,
                             len(seq.tokens) - len(seq.prompt_ids),
                             seq.arrival_time, seq.first_token_time)

    # -- device side --------------------------------------------------------------------------
    def _forward_fn(self, params, kv, last_tokens, ints, *_logits, shape):
        """The model over one ragged batch: logits of the sampled rows [S, V] (written over
        `_logits`, donated, in small steps) and the new KV. `shape` (T, S, P) tells how `ints`
        is laid out."""
        T, S, P = shape
        sizes = list(int_layout(T, S, P, self.rows).values())
        table, tok, pos, slot, src, qstart, ctx, last = jnp.split(ints, np.cumsum(sizes)[:-1])
        tok = jnp.where(src >= 0, last_tokens[jnp.maximum(src, 0)], tok)
        batch = Batch(qstart, ctx, table.reshape(S, P), slot, last)
        logits, kv = forward(params, self.config, tok, pos, kv, batch)
        if self._inputs is not None:  # on a mesh: whole rows for the sampler (it is lowered so)
            logits = jax.lax.with_sharding_constraint(logits, self._inputs)
        return logits, kv

    @staticmethod
    def _sample_fn(logits, last_tokens, history, ints, floats, *, S, mode, guided):
        """Sample each row, remember the tokens on the device, and pack the results in one
        int32 array [S, 2 + 2n]: token, logprob, top ids, top logprobs (floats bit-cast).
        The guided variant finds each row's bitmask and logit bias after the usual inputs."""
        n_rows, n_floats = len(sampling.INT_FIELDS) * S, len(sampling.FLOAT_FIELDS) * S
        sample_row, rows_i, extra = jnp.split(ints, [S, S + n_rows])
        floats, bias_values = jnp.split(floats, [n_floats])
        rows = sampling.Rows.from_packed(floats.reshape(-1, S), rows_i.reshape(-1, S))
        guide = None
        if guided:
            mask, bias_ids = jnp.split(extra, [extra.size - bias_values.size])
            guide = sampling.Guide(mask.reshape(S, -1), bias_ids.reshape(S, -1),
                                   bias_values.reshape(S, -1))
        new, lp, top_ids, top_lp = sampling.sample(logits, rows, history, mode, guide)
        last_tokens = last_tokens.at[jnp.where(sample_row >= 0, sample_row, -1)].set(new)
        history = sampling.record(history, sample_row, new)
        f2i = partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
        out = jnp.concatenate([new[:, None], f2i(lp)[:, None], top_ids, f2i(top_lp)], axis=1)
        return out, last_tokens, history

    def _lower(self, key):
        T, P = key
        S = min(T, self.max_num_seqs)
        n_int = sum(int_layout(T, S, P, self.rows).values())
        spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self._inputs)
        kv, last_tokens, _ = self.state
        args = [self.params, kv, last_tokens, spec((n_int,), jnp.int32)]
        kept = S * self.rows <= KEPT_LOGITS_ROWS
        if kept:
            args.append(spec((S * self.rows, self.config.vocab_size), jnp.float32))
        # keep_unused: the kept logits are never read, only donated to hold the new ones
        fn = self._jit(partial(self._forward_fn, shape=(T, S, P)), keep_unused=True,
                       donate_argnums=(1, 4) if kept else 1)
        with tuning.batch_invariant(self.batch_invariant):
            return fn.lower(*args)

    def _lower_sampler(self, S: int, mode: str, guided: bool | str = False):
        _, last_tokens, history = self.state
        V = self.config.vocab_size
        fn = self._jit(partial(self._sample_fn, S=S, mode=mode, guided=bool(guided)),
                       donate_argnums=(1, 2))
        spec = lambda n, dtype: jax.ShapeDtypeStruct((n,), dtype, sharding=self._inputs)
        extra = guided_layout(S, V) if guided else (0, 0)
        return fn.lower(jax.ShapeDtypeStruct((S, V), jnp.float32, sharding=self._inputs),
                        last_tokens, history,
                        spec(sum(sample_layout(S).values()) + extra[0], jnp.int32),
                        spec(len(sampling.FLOAT_FIELDS) * S + extra[1], jnp.float32))

    def _compile_now(self, key):
        self._exe[key] = self._lower(key).compile(compiler_options(key[0]))
        self.compilations += 1
        return self._exe[key]

    def _compile_sampler(self, S: int, mode: str, *guided):
        key = (S, mode, *guided)
        self._samplers[key] = self._lower_sampler(*key).compile()
        self.compilations += 1
        return self._samplers[key]

    def warmup(self, workers: int | None = None):
        """Compile every program a step can need (`warmup.py`); `warmup_report` says how long
        it took and what the persistent compilation cache held."""
        return warm_up(self, workers)

    # -- penalties' token history -------------------------------------------------------------
    def _compile_load(self):
        spec = [jax.ShapeDtypeStruct((HISTORY_CHUNK,), d) for d in (jnp.int32, jnp.int32, bool)]
        self._load = jax.jit(sampling.load_history, donate_argnums=0).lower(
            self.state[2], np.int32(0), *spec, np.bool_(True)).compile()
        self.compilations += 1

    def _load_history(self, seq: Sequence):
        """Fill the sequence's history row from its tokens (prompt + outputs so far)."""
        if self._load is None:
            self._compile_load()
        kv, last_tokens, history = self.state
        toks = np.asarray(seq.tokens, np.int32)
        for start in range(0, len(toks), HISTORY_CHUNK):
            part = toks[start:start + HISTORY_CHUNK]
            idx = start + np.arange(HISTORY_CHUNK)
            history = self._load(history, np.int32(seq.slot), np.resize(part, HISTORY_CHUNK),
                                 (idx >= len(seq.prompt_ids)).astype(np.int32),
                                 np.arange(HISTORY_CHUNK) < len(part), np.bool_(start == 0))
        self.state = (kv, last_tokens, history)
