"""Sampling parameters and the batched, jitted sampler.

Every row of a batch carries its own parameters. Penalties read a per-sequence state kept on
the device (token counts of the output, a mask of prompt tokens), one row per running
sequence, updated inside the step from the tokens it feeds. A seeded row draws its noise from
(seed, output index) alone, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, field, rule in checks:
            if not ok:
                raise ValueError(f"{field} {rule}, got {getattr(self, field)!r}")


class PenaltyState(NamedTuple):
    counts: jax.Array  # [rows, vocab] int32: times each token was generated
    in_prompt: jax.Array  # [rows, vocab] bool: token appears in the prompt


def init_state(rows: int, vocab: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows, vocab), bool))


def record_tokens(state: PenaltyState, rows, token_ids, is_output) -> PenaltyState:
    """Add fed tokens to their rows' state. rows < 0 (padding) are dropped."""
    rows = jnp.where(rows < 0, state.counts.shape[0], rows)
    counts = state.counts.at[rows, token_ids].add(is_output.astype(jnp.int32), mode="drop")
    in_prompt = state.in_prompt.at[rows, token_ids].max(~is_output, mode="drop")
    return PenaltyState(counts, in_prompt)


def reset_row(state: PenaltyState, row, token_ids, is_output, valid) -> PenaltyState:
    """Clear one row and load a history into it (tokens with valid False are ignored)."""
    state = PenaltyState(state.counts.at[row].set(0), state.in_prompt.at[row].set(False))
    rows = jnp.where(valid, row, -1)
    return record_tokens(state, rows, token_ids, is_output)


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters as arrays [S]."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array  # uint32
    position: jax.Array  # index of the token being drawn within the output

    @staticmethod
    def from_params(params: list[SamplingParams], seeds: list[int], positions: list[int], rows: int):
        """Pad to `rows` with greedy rows."""
        pad = rows - len(params)
        def col(f, dtype, fill):
            return np.asarray([f(p) for p in params] + [fill] * pad, dtype)
        return SamplingBatch(
            col(lambda p: p.temperature, np.float32, 0.0), col(lambda p: p.top_k, np.int32, 0),
            col(lambda p: p.top_p, np.float32, 1.0), col(lambda p: p.min_p, np.float32, 0.0),
            col(lambda p: p.repetition_penalty, np.float32, 1.0),
            col(lambda p: p.presence_penalty, np.float32, 0.0),
            col(lambda p: p.frequency_penalty, np.float32, 0.0),
            np.asarray(list(seeds) + [0] * pad, np.uint32),
            np.asarray(list(positions) + [0] * pad, np.int32))


def apply_penalties(logits, counts, in_prompt, s: SamplingBatch):
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens."""
    seen = in_prompt | (counts > 0)
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def filter_logits(logits, s: SamplingBatch):
    """Temperature, then top-k, top-p and min-p masks, computed on sorted logits.
    Returns (sorted masked logits [S, V], the vocabulary ids of the sorted order)."""
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    drop = (s.top_k[:, None] > 0) & (rank >= s.top_k[:, None])
    drop |= (jnp.cumsum(probs, axis=-1) - probs) >= s.top_p[:, None]  # keeps the first token
    drop |= probs < s.min_p[:, None] * probs[:, :1]
    return jnp.where(drop, -jnp.inf, ranked), order


def sample(logits, state: PenaltyState, rows, s: SamplingBatch):
    """logits [S, V] float32; rows [S] state row of each sequence (-1 = padding).
    Returns (tokens [S], logprob of each token [S], top ids [S, K], top logprobs [S, K])."""
    safe_rows = jnp.maximum(rows, 0)
    logits = apply_penalties(logits, state.counts[safe_rows], state.in_prompt[safe_rows], s)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)

    def draw(logits):
        masked, order = filter_logits(logits, s)
        keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
            s.seed, s.position)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:]))(keys)
        pick = jnp.argmax(masked + noise, axis=-1)
        return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]

    # The sort only runs when some row samples; an all-greedy batch skips it.
    drawn = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda _: greedy, logits)
    tokens = jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    return tokens, chosen, top_ids, top_lp
