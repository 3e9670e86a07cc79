"""Speculative decoding: proposers and the acceptance rule, hooked into the engine's own step.

A speculating sequence puts its newest token and k proposed tokens on the step's flat token axis
(1 + k query tokens; the ragged paged attention takes several per sequence) and the step returns
logits for each of them. Row j of a sequence is sampled exactly as plain decoding would sample
output index i + j (same seeded noise from (seed, index)), and the proposals are accepted while
they equal those samples; the first mismatch (or the token after the last proposal, the bonus)
is the target's own draw. The proposals are deterministic (prompt lookup; the draft model's
argmax), so this is rejection sampling (Leviathan et al. 2023, Chen et al. 2023) with a one-hot
proposal distribution q = [x]: x is accepted with probability min(1, p(x) / q(x)) = p(x), and a
rejection resamples from norm(max(p - q, 0)), which is p without x. Every emitted token thus has
exactly the target's distribution, and a seeded or greedy request emits the very tokens it
would have emitted without speculation.

After a step, the K/V slots of rejected proposals are rolled back (`num_computed` moves back to
the last accepted token, trailing pages go back to the pool) and are written over later.

Sequences with penalties do not speculate (their history would have to grow inside the step);
they decode one token a step beside the speculating ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from array import array
from pathlib import Path

from functools import partial

import numpy as np

from .batch import INDEX, BatchState, Packed, int_layout
from .scheduler import FINISHED, RUNNING, Chunk

METHODS = ("ngram", "draft_model")
DEFAULT_DRAFT = "default-draft"  # the draft shipped beside the embedded default model


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH,
    "num_speculative_tokens": 4}."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    @classmethod
    def parse(cls, spec) -> "SpeculativeConfig | None":
        """A dict, a JSON string, a SpeculativeConfig or None -> a checked config (or None)."""
        if spec is None or isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {spec!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; "
                             f"known: {sorted(known)}")
        if spec.get("method") not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, "
                             f"got {spec.get('method')!r}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        config = cls(**spec)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(config, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({config.prompt_lookup_min}) "
                             f"exceeds prompt_lookup_max ({config.prompt_lookup_max})")
        if config.method == "draft_model" and not config.model:
            raise ValueError('speculative_config.model (the draft checkpoint folder, or '
                             f'"{DEFAULT_DRAFT}") is required for method "draft_model"')
        return config

    def check_budget(self, max_num_batched_tokens: int):
        k = self.num_speculative_tokens
        if k + 1 > max_num_batched_tokens:
            raise ValueError(f"speculative_config.num_speculative_tokens ({k}) + 1 exceeds "
                             f"max_num_batched_tokens ({max_num_batched_tokens}): a verify step "
                             "must fit one step's token bucket")

    def describe(self) -> str:
        what = (f"ngram (prompt lookup {self.prompt_lookup_min}-{self.prompt_lookup_max})"
                if self.method == "ngram" else f"draft_model ({self.model})")
        return f"{what}, k={self.num_speculative_tokens}"


def draft_folder(model: str) -> Path:
    """The draft checkpoint folder; "default-draft" names the one beside the default model."""
    if model == DEFAULT_DRAFT:
        from ..model import default_model_path
        path = Path(default_model_path()) / "draft"
        if not (path / "model.safetensors").is_file():
            raise ValueError(f"the default model's draft is missing from {path} (train it: "
                             "python -m pallasite.train.default_draft --out DIR --install)")
        return path
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config.model: no checkpoint (config.json) at {path}")
    return path


def check_draft(spec, target_folder) -> "SpeculativeConfig | None":
    """Check a config against a target checkpoint before loading anything: the draft exists
    and shares the target's vocabulary (both configs read, no weights)."""
    config = SpeculativeConfig.parse(spec)
    if config is not None and config.method == "draft_model":
        from ..model import load_config
        draft = load_config(draft_folder(config.model))
        target = load_config(target_folder)
        check_vocab(draft.vocab_size, target.vocab_size)
    return config


def check_vocab(draft: int, target: int):
    if draft != target:
        raise ValueError(f"the draft model's vocabulary ({draft} tokens) differs from the "
                         f"target's ({target} tokens)")


@dataclasses.dataclass
class SpecState:
    """A sequence's speculation: counters, and how far the draft model's K/V reach."""
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verify steps that carried at least one proposal
    draft_computed: int = 0
    token_bytes: bytearray = dataclasses.field(default_factory=bytearray)  # prompt lookup's


# -- proposers ----------------------------------------------------------------------------------
def ngram_propose(tokens, k: int, n_min: int, n_max: int, data=None) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from n_max down
    to n_min) in the sequence itself, and propose the (up to k) tokens that followed it. The
    search is a byte search over the tokens as int32 (`data`, if the caller keeps them), so
    a match that straddles tokens is skipped for the next one back."""
    L = len(tokens)
    if data is None:
        data = array("i", tokens).tobytes()
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = data[4 * (L - n):4 * L]
        at = data.rfind(tail, 0, 4 * (L - 1))  # a match within the tokens before the last
        while at > 0 and at % 4:
            at = data.rfind(tail, 0, at + len(tail) - 1)
        if at >= 0:
            start = at // 4 + n
            return list(tokens[start:start + k])
    return []


class NgramProposer:
    needs_tokens_first = True  # proposals are known before the step is scheduled

    def __init__(self, config: SpeculativeConfig):
        self.k, self.n_min, self.n_max = (config.num_speculative_tokens, config.prompt_lookup_min,
                                          config.prompt_lookup_max)

    def plan(self, seq, limit: int) -> list[int]:
        data, tokens = seq.spec.token_bytes, seq.tokens  # the tokens' bytes, extended as they come
        if len(data) != 4 * len(tokens):
            del data[4 * min(len(tokens), len(data) // 4):]
            data += array("i", tokens[len(data) // 4:]).tobytes()
        return ngram_propose(tokens, min(self.k, limit), self.n_min, self.n_max, data)

    def propose(self, chunks):
        pass

    def after_verify(self, seq, chunk, accepted: int):
        pass


class DraftProposer:
    """A smaller model with its own K/V pages: the same page ids as the target (one allocator,
    one page table per sequence), in an array of its own shape. It computes every token the
    target computes, so prefix-cached pages hold its K/V too, then proposes its argmax."""

    def __init__(self, config: SpeculativeConfig, draft):
        self.k, self.model = config.num_speculative_tokens, draft

    def plan(self, seq, limit: int) -> list[int]:
        return [0] * min(self.k, limit)  # filled in by propose(), once the step is known

    def propose(self, chunks):
        pieces, spec = [], []
        for i, c in enumerate(chunks):
            st = c.seq.spec
            end = c.start + c.length - len(c.seq.draft)  # the verified tokens' end
            start = min(st.draft_computed, c.start)
            pieces.append((c.seq.tokens[start:end], start, c.seq.request_id))
            st.draft_computed = end
            if c.seq.draft:
                spec.append(i)
        if not pieces:
            return
        firsts = self.model.run(pieces)
        for i in spec:
            chunks[i].seq.draft[0] = int(firsts[i])
        for j in range(1, max((len(chunks[i].seq.draft) for i in spec), default=0)):
            live = [i for i in spec if len(chunks[i].seq.draft) > j]
            nxt = self.model.run([([chunks[i].seq.draft[j - 1]], chunks[i].start + j,
                                   chunks[i].seq.request_id) for i in live])
            for i, t in zip(live, nxt):
                chunks[i].seq.draft[j] = int(t)

    def after_verify(self, seq, chunk, accepted: int):
        # The draft wrote t, d1 .. d_{n-1}; d_n (when all were accepted) is still to write.
        n = len(seq.draft)
        seq.spec.draft_computed = chunk.start + 1 + min(accepted, max(n - 1, 0))


# -- the engine's hooks -------------------------------------------------------------------------
class Speculator:
    """What the engine calls: `plan` before scheduling, `propose` after it, `verify` on each
    speculating row of the results, `stats` for the totals."""

    def __init__(self, config: SpeculativeConfig, proposer):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.rows = self.k + 1  # logits rows per sequence in every step
        self.totals = dict(proposed=0, accepted=0, verify_steps=0)

    def plan(self, running, budget: int, max_model_len: int, skip=lambda seq: False):
        """Give each decoding sequence its proposal (or placeholders), within the step's spare
        token budget, its max_tokens (the step may emit every proposal plus one) and the
        context. Penalized sequences and those `skip` names (guided ones) decode plainly."""
        for seq in running:
            seq.draft = []
            if seq.spec is None:
                seq.spec = SpecState()
            if (seq.penalized or skip(seq) or seq.num_pending
                    or seq.total_len - seq.num_computed != 1):
                continue
            limit = min(budget, seq.max_output - seq.num_output - 1,
                        max_model_len - seq.total_len)
            if limit > 0:
                seq.draft = self.proposer.plan(seq, limit)
                budget -= len(seq.draft)

    def propose(self, chunks, admitted=()):
        """Fill in the step's proposals. A sequence just admitted (or readmitted after a
        preemption) starts at its cached prefix, whose pages hold the draft's K/V too: the
        draft computes every token the target computes, in the same step."""
        for c in chunks:
            if c.seq.spec is None:
                c.seq.spec = SpecState()
        for c in chunks:
            if c.seq in admitted:
                c.seq.spec.draft_computed = c.start
            # Only a decode chunk (the newest token, then the proposals) keeps its proposal; one
            # left from before a preemption is stale.
            if c.seq.draft and (c.length != 1 + len(c.seq.draft)
                                or c.start != c.seq.total_len - 2):
                c.seq.draft = []
        self.proposer.propose(chunks)

    def install(self, scheduler, batch=None):
        """Put the speculating decode pass and packing in place of the plain ones (the plain
        engine's fast path stays untouched)."""
        scheduler._decode = partial(decode_pass, scheduler)
        if batch is not None:
            batch.pack = partial(pack, batch, self.rows)

    def collect(self, engine, chunks, out) -> list:
        """The step's outputs: each sequence's rows are its newest token and each proposal."""
        out = out.reshape(-1, self.rows, out.shape[-1])
        return self.verify(engine, [(c, out[i]) for i, c in enumerate(chunks)
                                    if c.samples and c.seq.status != FINISHED])

    def spread(self, chunks) -> list:
        """The chunks at their sampler rows (chunk i at row i * rows), the rows between them
        padding that samples nothing."""
        pad = Chunk(None, 0, 0, False)
        return [x for c in chunks for x in [c] + [pad] * (self.rows - 1)]

    def warmup(self) -> int:
        """Compile the draft model's buckets; returns how many compilations that took."""
        model = getattr(self.proposer, "model", None)
        if model is None:
            return 0
        before = model.compilations
        model.warmup()
        return model.compilations - before

    def verify(self, engine, items) -> list:
        """For each (chunk, rows [k + 1, width], the sampler's rows of its sequence): accept the
        proposals that match the target's draws, emit them and the next draw, and roll the rest
        back. The emitted tokens go through the engine's `_accept` a position at a time for all
        sequences together: round j takes the j-th token of every sequence that has one."""
        counts = [self._judge(chunk, rows) for chunk, rows in items]
        outs = [[] for _ in items]
        for j in range(max(counts, default=-1) + 1):
            now = [i for i, a in enumerate(counts)
                   if a >= j and not (outs[i] and outs[i][-1].finished)]
            got = engine._accept([items[i][0].seq for i in now],
                                 np.stack([items[i][1][j] for i in now])) if now else []
            for i, o in zip(now, got):
                outs[i].append(o)
        for (chunk, _), o in zip(items, outs):
            if chunk.seq.draft and not o[-1].finished:
                engine.pages.shrink(chunk.seq.request_id, chunk.seq.total_len)
        return [merge(o, chunk.seq.spec) for (chunk, _), o in zip(items, outs)]

    def _judge(self, chunk, rows) -> int:
        """How many of the chunk's proposals the target drew too; the counts, and the rolled
        back proposals' K/V given up (their slots are written over later)."""
        seq, draft = chunk.seq, chunk.seq.draft
        a = 0
        while a < len(draft) and int(rows[a][0]) == draft[a]:
            a += 1
        if draft:
            seq.spec.proposed += len(draft)
            seq.spec.accepted += a
            seq.spec.steps += 1
            self.totals["proposed"] += len(draft)
            self.totals["accepted"] += a
            self.totals["verify_steps"] += 1
            seq.num_computed = chunk.start + 1 + a
            self.proposer.after_verify(seq, chunk, a)
        seq.num_pending += a  # _accept takes one pending token per emitted token
        return a

    def stats(self) -> dict:
        t = self.totals
        return dict(spec_proposed_tokens=t["proposed"], spec_accepted_tokens=t["accepted"],
                    spec_verify_steps=t["verify_steps"],
                    spec_mean_accepted=(1 + t["accepted"] / t["verify_steps"]
                                        if t["verify_steps"] else 0.0))


def merge(outs, spec: SpecState):
    """One output for the tokens a sequence emitted in one step."""
    last = outs[-1]
    lps = None if last.logprobs is None else [lp for o in outs for lp in o.logprobs]
    return last._replace(
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        text_delta=None if last.text_delta is None else "".join(o.text_delta for o in outs),
        logprobs=lps,
        spec_proposed=spec.proposed, spec_accepted=spec.accepted)


# -- the scheduler's decode pass and the step's packing while speculating ----------------------
def decode_pass(sched):
    """Scheduler._decode for a speculating engine: a decoding sequence with a proposal gets one
    chunk of its newest token and the proposals, with pages for all of them (short of free pages
    it decodes one token: speculation never preempts). `sched.drafted`: the proposals' tokens,
    which the step's budget leaves to them."""
    chunks, prefilling, before, drafted = [], [], sched.num_preemptions, 0
    tables = sched.pages.tables
    for seq in list(sched.running):
        start, total = seq.num_computed, seq.total_len
        if total - start != 1:
            if total - start > 1:
                prefilling.append(seq)
            continue
        if seq.status != RUNNING or total - len(seq.prompt_ids) >= seq.max_output:
            seq.draft = []
            continue  # preempted, or its pending token is its last (it ends on arrival)
        if seq.draft:
            table = tables[seq.request_id]
            held = len(table)
            if sched.pages.grow(seq.request_id, total + len(seq.draft)):
                sched.page_table[seq.slot, held:len(table)] = table[held:]
            else:
                seq.draft = []
        if not sched._grow(seq, total):
            seq.draft = []
            continue
        n = len(seq.draft)
        seq.num_computed, seq.num_pending = total + n, seq.num_pending + 1
        drafted += n
        chunks.append(Chunk(seq, start, 1 + n, True))
    sched.drafted = drafted
    return chunks, prefilling, sched.num_preemptions != before


def pack(state: BatchState, R: int, chunks) -> Packed:
    """BatchState.pack with R sampler rows per sequence: a chunk's last 1 + len(draft) tokens
    each get a logits row, row j drawn as output index (the next one) + j; the proposals are
    the chunk's last tokens (the host knows them all: a speculating engine does not overlap)."""
    packed = BatchState.pack(state, chunks)
    (T, P), n = packed.key, packed.n
    S = min(T, state.max_num_seqs)
    sizes = np.cumsum(list(int_layout(T, S, P).values()))[:-1]
    table, tok, pos, kv_slot, src, qstart, ctx, _ = np.split(packed.ints, sizes)
    ends = qstart[1:n + 1]
    dl = np.array([len(c.seq.draft) for c in chunks], np.int32)
    for i in np.flatnonzero(dl).tolist():
        e = int(ends[i])
        tok[e - dl[i]:e], src[e - 1] = chunks[i].seq.draft, -1
    # Row i * R + j of chunk i, for j <= len(draft): the logits after its (j + 1)-th last token.
    j = np.arange(R)[None, :]
    valid = j <= dl[:, None]
    which = np.repeat(np.arange(n), dl + 1)
    jj = np.broadcast_to(j, (n, R))[valid]
    r = (np.arange(n)[:, None] * R + j)[valid]
    last = np.zeros(S * R, np.int32)
    last[r] = ends[which] - 1 - dl[which] + jj
    sample_row, ints = packed.sample_ints[:S], packed.sample_ints[S:].reshape(-1, S)
    floats = packed.floats.reshape(-1, S)
    floats_r = np.repeat(state.neutral[0], S * R, axis=1)
    ints_r = np.repeat(state.neutral[1], S * R, axis=1)
    floats_r[:, r], ints_r[:, r] = floats[:, which], ints[:, which]
    ints_r[INDEX, r] -= dl[which] - jj
    rows_r = np.full(S * R, -1, np.int32)
    rows_r[np.arange(n) * R] = sample_row[:n]
    packed.ints = np.concatenate([table, tok, pos, kv_slot, src, qstart, ctx, last])
    packed.sample_ints = np.concatenate([rows_r, ints_r.ravel()])
    packed.floats = floats_r.ravel()
    return packed


def make_speculator(spec, *, target_config, params_dtype, pages, max_num_seqs: int,
                    max_num_batched_tokens: int, token_buckets, page_buckets, draft=None):
    """The engine's speculator for a config (dict, JSON or SpeculativeConfig), or None. The
    draft model is loaded from `config.model` unless `draft` (its config, params) is given."""
    config = SpeculativeConfig.parse(spec)
    if config is None:
        return None
    config.check_budget(max_num_batched_tokens)
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config))
    from .draft_model import DraftModel
    if draft is None:
        from ..model import load_hf
        draft = load_hf(draft_folder(config.model), dtype=params_dtype)
    draft_config, draft_params = draft
    check_vocab(draft_config.vocab_size, target_config.vocab_size)
    # The draft computes what the target does, plus at most one token a sequence that it lags
    # behind (the last proposal of a fully accepted run): its largest bucket is that much wider.
    buckets = sorted(token_buckets)
    model = DraftModel(draft_config, draft_params, pages, max_num_seqs=max_num_seqs,
                       token_buckets=buckets[:-1] + [max(buckets[-1], max_num_batched_tokens)
                                                     + max_num_seqs],
                       page_buckets=page_buckets)
    return Speculator(config, DraftProposer(config, model))


# -- command line -------------------------------------------------------------------------------
def _parse_flag(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_argument(parser):
    """--speculative-config JSON, checked as the flag is read (a bad one is a usage error), and
    --batch-invariant."""
    parser.add_argument("--speculative-config", type=_parse_flag, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                             '"model": "default-draft", "num_speculative_tokens": 4}\'')
    parser.add_argument("--batch-invariant", action="store_true",
                        help="sum each row's products and attention in an order the rest of "
                             "the batch does not change (speculation's greedy tokens are then "
                             "plain decoding's), at about 1.2x the step time on a GPU")


def check_cli(prog: str, spec, target_folder):
    """A draft that is missing or has another vocabulary is a usage error (exit 2), found
    before any weights load."""
    try:
        check_draft(spec, target_folder)
    except ValueError as e:
        print(f"{prog}: error: argument --speculative-config: {e}", file=sys.stderr)
        raise SystemExit(2) from None
