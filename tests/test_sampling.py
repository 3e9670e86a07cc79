"""The batched sampler: seeded draws independent of the batch, filters that never leak,
penalties equal to their formula, logprobs, and the device-side token history."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.serving import sampling as S

V = 48
sample = jax.jit(S.sample)


def rows(params: list[dict], num_rows=None):
    floats, ints = S.pack_rows(params, num_rows or len(params))
    return S.Rows.from_packed(jnp.asarray(floats), jnp.asarray(ints))


def draw(logits, params, history=None, num_rows=None):
    n = num_rows or len(params)
    logits = np.concatenate([logits, np.zeros((n - len(logits), V), np.float32)])
    history = S.init_history(1, V) if history is None else history
    out = sample(jnp.asarray(logits), rows(params, n), history)
    return [np.asarray(x)[:len(params)] for x in out]


def random_logits(n, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(0, scale, (n, V)).astype(np.float32)


def test_greedy_is_argmax_and_logprobs_are_the_models():
    logits = random_logits(5)
    tokens, lp, top_ids, top_lp = draw(logits, [dict(temperature=0.0, logprobs=3)] * 5)
    assert (tokens == logits.argmax(-1)).all()
    ref = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(lp, ref[np.arange(5), tokens], rtol=1e-5)
    np.testing.assert_array_equal(top_ids[:, 0], tokens)
    np.testing.assert_allclose(top_lp[:, :3], -np.sort(-np.asarray(ref), -1)[:, :3], rtol=1e-5)


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = random_logits(6, seed=1, scale=1.0)
    mine = dict(temperature=0.9, top_p=0.95, seed=1234, index=17)
    others = [dict(temperature=t, top_k=k, seed=s, index=i)
              for t, k, s, i in ((0.0, 0, 0, 0), (1.5, 5, 9, 3), (0.7, 0, 3, 1), (1.0, 2, 5, 8))]
    alone = draw(logits[2:3], [mine])[0][0]
    padded = draw(logits[2:3], [mine], num_rows=8)[0][0]
    crowded = draw(logits[[0, 1, 2, 3, 4]], others[:2] + [mine] + others[2:])[0][2]
    reordered = draw(logits[[4, 2, 0]], [others[0], mine, others[3]])[0][1]
    assert alone == padded == crowded == reordered
    again = [draw(logits[2:3], [dict(mine, index=i)])[0][0] for i in range(40)]
    assert len(set(again)) > 3, "the output index must change the draw"
    assert again == [draw(logits[2:3], [dict(mine, index=i)])[0][0] for i in range(40)]


def test_draws_follow_the_softmax():
    logits = random_logits(1, seed=2, scale=1.0)
    n = 4000
    tokens = draw(np.repeat(logits, n, 0), [dict(temperature=0.8, seed=s) for s in range(n)])[0]
    p = np.asarray(jax.nn.softmax(logits[0] / 0.8))
    freq = np.bincount(tokens, minlength=V) / n
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n)


def allowed(logit_row, t, top_k, top_p, min_p):
    """The set each filter keeps, written from the probabilities."""
    p = np.exp((logit_row - logit_row.max()) / t)
    p /= p.sum()
    keep = np.ones(V, bool)
    if top_k:
        keep &= np.array([np.sum(p > x) < top_k for x in p])
    if top_p < 1:
        q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        order = np.argsort(-q)
        mass = np.cumsum(q[order])
        n = int(np.searchsorted(mass, top_p) + 1)  # smallest prefix with mass >= top_p
        nucleus = np.zeros(V, bool)
        nucleus[order[:n]] = True
        keep &= nucleus
    if min_p:
        keep &= p >= min_p * p.max()
    return keep


@pytest.mark.parametrize("t,top_k,top_p,min_p", [
    (1.0, 3, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (0.7, 0, 1.0, 0.2), (2.0, 8, 0.7, 0.05),
    (1.0, 1, 1.0, 0.0)])
def test_filters_never_pick_an_excluded_token(t, top_k, top_p, min_p):
    logits = random_logits(3, seed=3, scale=1.5)
    n = 300
    for r in range(3):
        params = [dict(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p, seed=s, index=r)
                  for s in range(n)]
        picked = set(draw(np.repeat(logits[r:r + 1], n, 0), params)[0].tolist())
        keep = allowed(logits[r], t, top_k, top_p, min_p)
        assert picked <= set(np.flatnonzero(keep)), (picked, np.flatnonzero(keep))
        assert keep.sum() == 1 or len(picked) > 1


def test_penalties_match_the_formula():
    logits = random_logits(3, seed=4)
    rng = np.random.default_rng(5)
    history = S.init_history(4, V)
    load = jax.jit(S.load_history)
    hists = []
    for row in range(3):
        prompt, output = rng.integers(0, V, 10), rng.integers(0, V, 12)
        toks = np.concatenate([prompt, output]).astype(np.int32)
        is_out = np.arange(len(toks)) >= len(prompt)
        # Loaded in two slices, the first clearing whatever the row held.
        history = load(history, row + 1, toks[:8], is_out[:8], np.ones(8, bool), True)
        history = load(history, row + 1, np.pad(toks[8:], (0, 2)), np.pad(is_out[8:], (0, 2)),
                       np.arange(16) < 14, False)
        hists.append((prompt, output))
    np.testing.assert_array_equal(history.counts[0], 0)
    params = [dict(temperature=0.0, repetition_penalty=1.3, history_row=1),
              dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, history_row=2),
              dict(temperature=0.0, repetition_penalty=0.8, presence_penalty=-0.3,
                   frequency_penalty=0.1, history_row=3)]
    r = rows(params)
    got = S.apply_penalties(logits, history.seen[r.history_row], history.counts[r.history_row], r)
    for i, ((prompt, output), p) in enumerate(zip(hists, params)):
        want = logits[i].astype(np.float64).copy()
        rep = p.get("repetition_penalty", 1.0)
        for tok in set(prompt) | set(output):
            want[tok] = want[tok] / rep if want[tok] > 0 else want[tok] * rep
        counts = np.bincount(output, minlength=V)
        want -= p.get("frequency_penalty", 0.0) * counts + p.get("presence_penalty", 0.0) * (counts > 0)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    # The sampler uses them: a huge presence penalty forbids every generated token.
    banned = dict(temperature=0.0, presence_penalty=2.0, history_row=2)
    tokens = draw(logits[1:2] * 0.01, [banned], history)[0]
    assert tokens[0] not in set(hists[1][1])


def test_record_counts_sampled_tokens():
    history = S.init_history(2, V)
    history = S.record(history, jnp.array([0, 1, -1, 0]), jnp.array([5, 6, 7, 5]))
    assert int(history.counts[0, 5]) == 2 and int(history.counts[1, 6]) == 1
    assert bool(history.seen[0, 5]) and not bool(history.seen[0, 7])
    assert int(history.counts[:2].sum()) == 3  # the padding row went to the scratch row


@pytest.mark.parametrize("params,mode", [
    (dict(temperature=0.0), "greedy"),
    (dict(temperature=0.0, top_k=3, top_p=0.5), "greedy"),  # filters only shape a random draw
    (dict(temperature=0.0, logprobs=2), "sample"),
    (dict(temperature=0.0, repetition_penalty=1.5), "sample"),
    (dict(temperature=0.9, seed=4), "sample"),
    (dict(temperature=0.9, seed=4, top_k=5), "filter"),
    (dict(temperature=0.9, seed=4, min_p=0.2), "filter"),
])
def test_each_mode_draws_what_the_full_sampler_draws(params, mode):
    """The host picks the cheapest compiled variant; for the rows it picks it for, that variant
    gives the full sampler's tokens."""
    p = {**dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0), **params}
    penalized = p["repetition_penalty"] != 1
    assert S.MODES[S.mode_of(p["temperature"], p["top_k"], p["top_p"], p["min_p"], penalized,
                             "logprobs" in params)] == mode
    logits = random_logits(4, seed=7)
    history = S.record(S.init_history(4, V), jnp.arange(4), jnp.asarray(logits.argmax(-1)))
    r = rows([{**params, "index": i, "history_row": i} for i in range(4)])
    full = jax.jit(S.sample, static_argnums=3)(jnp.asarray(logits), r, history, "filter")
    cheap = jax.jit(S.sample, static_argnums=3)(jnp.asarray(logits), r, history, mode)
    np.testing.assert_array_equal(cheap[0], full[0])
    if "logprobs" in params:
        np.testing.assert_allclose(cheap[1], full[1], rtol=1e-6)
