"""The batch as the host keeps it between steps, and the packing of one step.

Everything per sequence that a step needs and that does not change from step to step lives in
arrays indexed by the sequence's slot: the sampler's parameters (written once, at admission),
the prompt length, the sampler variant, and the page table (the scheduler's `page_table`,
written only where pages change). Packing a step is then a handful of numpy gathers over the
step's slots (the scheduler hands the step over as arrays, `scheduler.Step`); the only
per-sequence Python is gathering the tokens the host knows of rows that have any to send (prefill
chunks; decode rows only when the host does not run a step ahead).

A step's device input is two flat arrays (one transfer each): int32 (`int_layout`: the forward
pass's token axis and batch metadata, then the sampler's rows) and float32 (the sampler's
float parameters).
"""

from __future__ import annotations

import itertools

import numpy as np

from . import sampling
from .scheduler import Step

INDEX = list(sampling.INT_FIELDS).index("index")  # rows of the sampler's int parameters
HISTORY_ROW = list(sampling.INT_FIELDS).index("history_row")
LOGPROBS = list(sampling.INT_FIELDS).index("logprobs")


def int_layout(T: int, S: int, P: int, R: int = 1) -> dict[str, int]:
    """The pieces of a step's int32 input to the forward pass, in order, and their sizes. R:
    logits rows per sequence (1 + the speculative tokens, `speculative.py`). The page table
    comes first: XLA passes a slice of the buffer to a kernel as a view at its offset, and the
    Mosaic GPU kernels take only operands aligned to 256 bytes."""
    return dict(page_table=S * P, tokens=T, positions=T, kv_slots=T, sources=T,
                query_start=S + 1, context_lens=S, logits_indices=S * R)


def sample_layout(S: int) -> dict[str, int]:
    """The pieces of a step's int32 input to the sampler."""
    return dict(sample_rows=S, rows=len(sampling.INT_FIELDS) * S)


class Packed:
    """One step's host arrays and its shape key (T, P); `S` rows, `n` of them real."""
    __slots__ = ("ints", "sample_ints", "floats", "key", "mode", "n", "stats")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class BatchState:
    def __init__(self, max_num_seqs: int, page_size: int, page_table: np.ndarray,
                 token_buckets: list[int], page_buckets: list[int]):
        self.max_num_seqs, self.page_size, self.page_table = max_num_seqs, page_size, page_table
        self.token_buckets, self.page_buckets = token_buckets, page_buckets
        self.neutral = sampling.pack_rows([], 1)  # a padding row: ([6, 1], [5, 1])
        self.floats, self.ints = sampling.pack_rows([], max_num_seqs)  # [6, R], [5, R]
        self.prompt_len = np.zeros(max_num_seqs, np.int64)
        self.mode = np.zeros(max_num_seqs, np.int8)
        # What each step's outputs repeat for a slot's request (engine._accept reads them).
        self.request_id = np.full(max_num_seqs, None, object)
        self.arrival = np.zeros(max_num_seqs)
        self.first_token = np.zeros(max_num_seqs)  # time of its first token, once it has one
        self.cached = np.zeros(max_num_seqs, np.int64)
        self.quiet = np.zeros(max_num_seqs, bool)  # outputs at its first token and end only

    def admit(self, seq):
        """Write a newly admitted sequence's constant rows into its slot."""
        floats, ints = seq.row
        self.floats[:, seq.slot], self.ints[:, seq.slot] = floats[:, 0], ints[:, 0]
        self.ints[HISTORY_ROW, seq.slot] = seq.slot
        self.prompt_len[seq.slot], self.mode[seq.slot] = len(seq.prompt_ids), seq.mode
        self.request_id[seq.slot], self.arrival[seq.slot] = seq.request_id, seq.arrival_time
        self.cached[seq.slot] = seq.cached_tokens
        self.first_token[seq.slot] = seq.first_token_time or 0.0
        self.quiet[seq.slot] = seq.quiet

    def pack(self, step) -> Packed:
        """Lay a step's rows (a Step, or a list of Chunks) out on one flat token axis, padded to
        the smallest bucket that fits."""
        if not isinstance(step, Step):
            step = Step.from_chunks(step)
        ps, n, seqs = self.page_size, len(step), step.seqs
        slot, start, length, samples = step.slots, step.start, step.length, step.samples
        ctx = start + length
        N = int(length.sum())
        T = next(b for b in self.token_buckets if b >= N)
        P = next(b for b in self.page_buckets if b >= -(-int(ctx.max()) // ps))
        S = min(T, self.max_num_seqs)
        # Each piece is written in place, in one buffer laid out as int_layout says.
        sizes = list(int_layout(T, S, P).values())
        ints_all = np.empty(sum(sizes), np.int32)
        table, tok, pos, kv_slot, src, qstart, ctx_lens, last = np.split(
            ints_all, np.cumsum(sizes)[:-1])

        # The token axis: each chunk's tokens back to back, then padding (no KV write).
        ends = np.cumsum(length)
        row = np.repeat(np.arange(n), length)  # chunk of each token
        p = np.arange(N) - np.repeat(ends - length - start, length)
        pos[:N], pos[N:] = p, 0
        W = self.page_table.shape[1]
        kv_slot[:N] = self.page_table.ravel()[slot[row] * W + p // ps] * ps + p % ps
        kv_slot[N:] = -1
        # Tokens the host knows; a chunk whose newest token is still on the device reads it
        # from the slot's last sample (every decode row, when the host runs a step ahead).
        have = np.minimum(np.maximum(step.known - start, 0), length)
        tok[:] = 0
        some = np.flatnonzero(have)
        if len(some):
            st, hv = start[some].tolist(), have[some].tolist()
            tok[:N][p - start[row] < have[row]] = np.fromiter(itertools.chain.from_iterable(
                seqs[i].tokens[a:a + h] for i, a, h in zip(some.tolist(), st, hv)), np.int32,
                sum(hv))
        late = have < length
        src[:] = -1
        src[ends[late] - 1] = slot[late]

        qstart[0], qstart[1:n + 1], qstart[n + 1:] = 0, ends, N
        ctx_lens[:n], ctx_lens[n:] = ctx, 0
        last[:n], last[n:] = ends - 1, 0
        # Only the pages of the context: a prefill chunk's sequence may hold pages past it (a
        # decode row's pages end at its context), and none reaches past the longest context.
        table = table.reshape(S, P)
        w = min(-(-int(ctx.max()) // ps), W)  # a page bucket may be wider than any table
        table[:n, :w], table[:n, w:], table[n:] = self.page_table[slot, :w], 0, 0
        wide = np.flatnonzero((length > 1) | ~samples)
        if len(wide):
            used = np.arange(P)[None, :] < -(-ctx[wide, None] // ps)
            table[wide] = np.where(used, table[wide], 0)

        # The sampler's rows: gathered from the slots; padding rows are neutral and draw nothing.
        floats = np.empty((len(self.floats), S), self.floats.dtype)
        sample_ints = np.empty((1 + len(self.ints)) * S, self.ints.dtype)
        sample_row, ints = sample_ints[:S], sample_ints[S:].reshape(-1, S)
        floats[:, :n], floats[:, n:] = self.floats[:, slot], self.neutral[0]
        ints[:, :n], ints[:, n:] = self.ints[:, slot], self.neutral[1]
        ints[INDEX, :n] = ctx - self.prompt_len[slot]  # the output index being drawn
        sample_row[:n], sample_row[n:] = np.where(samples, slot, -1), -1
        drawn = slot[samples]
        mode = int(self.mode[drawn].max()) if len(drawn) else 0
        return Packed(ints=ints_all, sample_ints=sample_ints, floats=floats.ravel(), key=(T, P),
                      mode=sampling.MODES[mode], n=n, stats=(start, length, samples))

    @staticmethod
    def describe(packed: Packed) -> dict:
        """What a step holds, for the step log (benchmarks): tokens, rows, the K/V it reads and
        the (query, key) pairs its attention computes."""
        start, length, samples = (a.astype(np.int64) for a in packed.stats)
        ctx, decode = start + length, (length == 1) & (samples > 0)
        return dict(T=packed.key[0], P=packed.key[1], rows=packed.n, tokens=int(length.sum()),
                    decode_rows=int(decode.sum()), sampled_rows=int(samples.sum()),
                    context_tokens=int(ctx.sum()), decode_context=int(ctx[decode].sum()),
                    attended_tokens=int((length * start + length * (length + 1) // 2).sum()))
