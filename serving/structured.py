"""Structured output and logit bias: what a request may generate, as a token bitmask per step.

A request's `StructuredOutput` (a JSON schema, any JSON object, a regex, a choice of strings or a
Lark grammar) is compiled by llguidance into a matcher that follows the request's tokens; before
each step that samples for it, the host fills the row's bitmask (1 bit per token, 32 to an
int32), and the sampler's "guided" variant applies it on the device, with each row's sparse
`logit_bias`, inside the same jitted call (`sampling.sample(..., guide=...)`). Steps where no row
is constrained or biased run the plain variants and pay nothing.

Why llguidance (benchmarks/bench_grammar.py, docs/structured.md): it compiles a JSON schema
lazily, in about a millisecond where xgrammar precompiles for tens of milliseconds to seconds,
its mask costs tens of microseconds a token, and it is one self-contained wheel; xgrammar pulls in
torch, triton, transformers and pydantic.

A mask depends on the row's previous token, which the engine (running one step ahead of the
host) may not have read back yet. So when a constrained row samples in a step whose predecessor is
still in flight, the engine dispatches the step's forward pass, then reads the previous step back
(`Guide.needs_sync`), fills the masks and only then dispatches the sampler: the forward pass still
runs ahead of the host, and the host's reading, mask filling and packing overlap it. Constrained
rows advance one token every step.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict

import numpy as np

MAX_LOGIT_BIAS = 300  # entries of logit_bias per request (the sampler's static width)
CACHE_SIZE = 256  # compiled grammars kept
# Compact JSON (no free whitespace): a weak model cannot wander off into blank space, and a
# schema's own "x-guidance" options still override this.
JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A grammar, schema, regex or choice that cannot be compiled; the message says why."""


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; set exactly one field. `grammar` is in llguidance's Lark
    syntax (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)."""
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        set_ = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise StructuredOutputError(f"set exactly one of json_schema, json_object, regex, "
                                        f"choice, grammar (got {set_ or 'none'})")

    def key(self) -> str:
        schema = self.json_schema
        if isinstance(schema, dict):
            schema = json.dumps(schema, sort_keys=True)
        return json.dumps([schema, self.json_object, self.regex, self.choice, self.grammar])

    def to_grammar(self) -> str:
        """The llguidance grammar text."""
        from llguidance import LLMatcher
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.json_schema is not None:
            try:
                schema = (json.loads(self.json_schema) if isinstance(self.json_schema, str)
                          else self.json_schema)
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as e:
                raise StructuredOutputError(f"json_schema is not a JSON object: {e}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, self.choice)))
        return LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and vocabulary; compiled grammars are cached
    (LRU) and each request gets its own copy of the matcher. Safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        import llguidance
        eos = sorted(eos_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size,
                                                eos_token=eos or None)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of `spec`'s grammar; StructuredOutputError if invalid."""
        from llguidance import LLMatcher
        key = spec.key()
        with self._lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
        if base is None:
            grammar = spec.to_grammar()
            base = LLMatcher(self.tokenizer, grammar, log_level=0)
            if base.is_error():
                raise StructuredOutputError(base.get_error())
            with self._lock:
                self._cache[key] = base
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return base.deep_copy()


def pack_bias(logit_bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """A request's logit_bias as fixed-width (ids, values); padding adds 0 to token 0."""
    ids, vals = np.zeros(MAX_LOGIT_BIAS, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
    items = list((logit_bias or {}).items())
    ids[:len(items)] = [int(t) for t, _ in items]
    vals[:len(items)] = [float(b) for _, b in items]
    return ids, vals


class Guide:
    """The engine's hook: builds the guided sampler's extra inputs for a step and advances each
    constrained request's matcher by its sampled tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=()):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.words = (vocab_size + 31) // 32
        self._compiler, self._lock = None, threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler | None:
        """Built on first use (it reads the whole vocabulary); None without a tokenizer."""
        with self._lock:
            if self._compiler is None and getattr(self.tokenizer, "tok", None) is not None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._compiler

    def check(self, sp):
        """Raise ValueError for a request that cannot be guided (any thread)."""
        spec = getattr(sp, "structured_output", None)
        if spec is not None:
            if self.compiler is None:
                raise StructuredOutputError("structured output needs the model's tokenizer "
                                            "(tokenizer.json)")
            self.compiler.matcher(spec)  # compiles now, in the caller's thread; then cached
        bad = [t for t in (getattr(sp, "logit_bias", None) or {}) if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token {bad[0]}, outside the vocabulary "
                             f"(vocab_size {self.vocab_size})")

    def start(self, seq):
        """Set the sequence's guide state at admission to the engine."""
        sp = seq.sampling
        spec = getattr(sp, "structured_output", None)
        seq.matcher = self.compiler.matcher(spec) if spec is not None else None
        seq.bias = pack_bias(sp.logit_bias) if getattr(sp, "logit_bias", None) else None

    @staticmethod
    def guided(seq) -> bool:
        return getattr(seq, "matcher", None) is not None or getattr(seq, "bias", None) is not None

    @staticmethod
    def needs_sync(chunks) -> bool:
        """Whether a constrained row samples in this step while its previous sample is still on
        the device (two pending: that one and this step's)."""
        return any(c.samples and getattr(c.seq, "matcher", None) is not None
                   and c.seq.num_pending > 1 for c in chunks)

    def step_inputs(self, chunks, S: int):
        """None when no sampling row is guided; else (ints, floats) to append to the sampler's
        inputs: bitmask [S, W] and bias ids [S, K] (int32), bias values [S, K] (float32)."""
        rows = [(i, c.seq) for i, c in enumerate(chunks)
                if c.samples and self.guided(c.seq) and c.seq.status != "finished"]
        if not rows:
            return None
        mask = np.full((S, self.words), -1, np.int32)
        ids, vals = np.zeros((S, MAX_LOGIT_BIAS), np.int32), np.zeros((S, MAX_LOGIT_BIAS), np.float32)
        matchers = [(s.matcher, i) for i, s in rows if s.matcher is not None]
        if matchers:  # logit bias alone needs no grammar engine
            from llguidance.numpy import fill_next_token_bitmask_par
            fill_next_token_bitmask_par(self.compiler.executor, matchers, mask)
        for i, s in rows:
            if s.bias is not None:
                ids[i], vals[i] = s.bias
        return np.concatenate([mask.ravel(), ids.ravel()]), vals.ravel()

    @staticmethod
    def accept(seq, token: int) -> bool:
        """Advance the matcher; True when the grammar is complete (the output may stop)."""
        m = getattr(seq, "matcher", None)
        if m is None:
            return False
        m.consume_token(token)
        return m.is_stopped() or m.is_error()


def guided_layout(S: int, vocab_size: int) -> tuple[int, int]:
    """Sizes of the guided sampler's extra (ints, floats)."""
    return S * ((vocab_size + 31) // 32) + S * MAX_LOGIT_BIAS, S * MAX_LOGIT_BIAS
