"""The batched sampler: per-row parameters in one jitted function.

Each row carries its own temperature (0 = greedy), top-k, top-p, min-p, repetition / presence /
frequency penalties, seed and output index. A row's random noise comes from (seed, index) alone,
so a seeded request draws the same tokens whatever shares its batch and however it was
scheduled. The costly parts (penalties, the sort behind top-k/top-p, the noise, top-n logprobs)
are compiled into separate variants (`MODES`) and the host, which knows every row's
parameters, picks one per step: an all-greedy batch pays only for an argmax, and no step holds a
`lax.cond`, whose predicate XLA:GPU reads back on the host (a stall that would stop the host
from running ahead of the device).

Penalties need each sequence's token history. It lives on the device as `History`, one row per
sequence slot: `seen` (prompt or output token) and `counts` (times generated). A row is loaded
from the host when its sequence is admitted and then grows by the tokens sampled in each step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20
MODES = ("greedy", "sample", "filter")  # argmax only; + penalties, noise, logprobs; + top-k/p  # top-n logprobs are computed for this many; a request may ask for fewer

# Per-row parameters and the value that switches each off; padding rows use these.
FLOAT_FIELDS = dict(temperature=0.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0)
INT_FIELDS = dict(top_k=0, seed=0, index=0, logprobs=-1, history_row=-1)


class Rows(NamedTuple):
    """Per-row sampling parameters, each [S]. seed is a 32-bit pattern; index the position of
    the token being drawn within the output; logprobs -1 = none wanted; history_row the row of
    `History` (-1: the row ignores history)."""
    temperature: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    top_k: jax.Array
    seed: jax.Array
    index: jax.Array
    logprobs: jax.Array
    history_row: jax.Array

    @staticmethod
    def from_packed(floats, ints) -> "Rows":
        return Rows(*floats, *ints)


def pack_rows(rows: list[dict], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side: a dict of field values per row -> (floats [6, S] f32, ints [5, S] i32), padded
    with neutral rows. Missing fields take their neutral value."""
    rows = list(rows) + [{}] * (num_rows - len(rows))  # row by row: one request's row is cheap
    floats = np.array([[r.get(f, d) for f, d in FLOAT_FIELDS.items()] for r in rows], np.float32)
    ints = np.array([[r.get(f, d) for f, d in INT_FIELDS.items()] for r in rows], np.int64)
    floats, ints = floats.reshape(num_rows, -1).T, ints.reshape(num_rows, -1).T
    return (np.ascontiguousarray(floats),
            np.ascontiguousarray(ints.astype(np.uint32)).view(np.int32))  # seeds may use 32 bits


class History(NamedTuple):
    seen: jax.Array  # [R + 1, V] bool: token in the prompt or the output; row R is scratch
    counts: jax.Array  # [R + 1, V] int32: times generated


def init_history(num_rows: int, vocab: int) -> History:
    return History(jnp.zeros((num_rows + 1, vocab), bool), jnp.zeros((num_rows + 1, vocab), jnp.int32))


def load_history(history: History, row, tokens, is_output, valid, reset) -> History:
    """Add a slice of one sequence's tokens [K] to row `row` (cleared first if `reset`)."""
    seen, counts = history
    keep = jnp.where(reset, False, seen[row])
    seen, counts = seen.at[row].set(keep), counts.at[row].set(jnp.where(reset, 0, counts[row]))
    rows = jnp.where(valid, row, seen.shape[0] - 1)
    return History(seen.at[rows, tokens].set(True), counts.at[rows, tokens].add(is_output))


def record(history: History, rows, tokens) -> History:
    """Count freshly sampled tokens [S] in their rows (-1 = not a real sample: scratch row)."""
    rows = jnp.where(rows < 0, history.seen.shape[0] - 1, rows)
    return History(history.seen.at[rows, tokens].set(True), history.counts.at[rows, tokens].add(1))


def apply_penalties(logits, seen, counts, rows: Rows):
    """Repetition penalty on every seen token (positive logits divided, negative multiplied);
    presence and frequency penalties on generated tokens."""
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - rows.frequency_penalty[:, None] * counts
            - rows.presence_penalty[:, None] * (counts > 0))


def filter_logits(scaled, rows: Rows):
    """Mask (-inf) what top-k, then top-p, then min-p exclude. Thresholds are logit values, so
    ties with the last kept token are kept too."""
    V = scaled.shape[-1]
    ranked = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, V), V)
    in_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better-ranked tokens
    n_p = jnp.maximum(jnp.sum(in_k & (before < rows.top_p[:, None]), axis=-1), 1)
    n = jnp.where(rows.top_p >= 1, k, n_p)
    threshold = jnp.take_along_axis(ranked, (n - 1)[:, None], axis=-1)[:, 0]
    # min-p: p >= min_p * p_max  <=>  logit >= max logit + log(min_p)
    min_p = jnp.where(rows.min_p > 0, ranked[:, 0] + jnp.log(jnp.maximum(rows.min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(threshold, min_p)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def mode_of(temperature, top_k, top_p, min_p, penalized: bool, logprobs: bool) -> int:
    """The cheapest variant (an index into MODES) that serves a request's rows."""
    if temperature > 0 and (top_k > 0 or top_p < 1 or min_p > 0):
        return 2
    return 1 if temperature > 0 or penalized or logprobs else 0


def _draw(logits, rows: Rows, filtering: bool):
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
    scaled = logits / t[:, None]
    if filtering:
        scaled = filter_logits(scaled, rows)
    seeds = jax.lax.bitcast_convert_type(rows.seed, jnp.uint32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, rows.index)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)  # Gumbel-max: a softmax draw


class Guide(NamedTuple):
    """Per-row token constraints of the "guided" variants: bitmask [S, ceil(V/32)] int32 (bit
    t%32 of word t//32 set: token t allowed; all ones for a free row) and a sparse logit bias,
    ids and values [S, K] (padding: +0 on token 0)."""
    bitmask: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array


def apply_guide(logits, guide: Guide):
    """Add each row's logit bias, then send the tokens its bitmask forbids to -inf."""
    S, V = logits.shape
    logits = logits.at[jnp.arange(S)[:, None], guide.bias_ids].add(guide.bias_values)
    bits = (guide.bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # no gather
    return jnp.where(bits.reshape(S, -1)[:, :V] == 1, logits, -jnp.inf)


def _full(logits, rows: Rows, history: History, filtering: bool, guide: Guide | None = None):
    """Penalties, sampling (or argmax for greedy rows) and logprobs, for every row."""
    r = jnp.where(rows.history_row < 0, history.seen.shape[0] - 1, rows.history_row)
    penalized = apply_penalties(logits if guide is None else apply_guide(logits, guide),
                                history.seen[r], history.counts[r], rows)
    tokens = jnp.where(rows.temperature > 0, _draw(penalized, rows, filtering),
                       jnp.argmax(penalized, axis=-1).astype(jnp.int32))
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, lp.shape[-1]))
    return tokens, jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids, top_lp


def _greedy(logits):
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    n = min(MAX_LOGPROBS, logits.shape[-1])
    return (tokens, jnp.zeros(tokens.shape, jnp.float32), jnp.zeros((*tokens.shape, n), jnp.int32),
            jnp.zeros((*tokens.shape, n), jnp.float32))


def sample(logits, rows: Rows, history: History, mode: str = "filter", guide: Guide | None = None):
    """logits [S, V] float32 -> tokens [S] int32, their logprobs [S], top ids [S, n] and top
    logprobs [S, n] (n = MAX_LOGPROBS). Logprobs are of the model's own distribution (before
    penalties, temperature and filters), and zeros in the "greedy" mode.

    `mode` (static, one of MODES) must cover every row: "greedy" ignores temperature,
    penalties and logprobs; "sample" ignores top-k, top-p and min-p; "filter" does everything.
    A `guide` (the guided variants) constrains and biases what is drawn, not the logprobs."""
    if mode == "greedy":
        return _greedy(logits if guide is None else apply_guide(logits, guide))
    return _full(logits, rows, history, filtering=mode == "filter", guide=guide)
