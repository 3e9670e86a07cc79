"""Logit parity with `transformers` for every family, and the paged forward against the dense."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
import torch

import hf_models
from pallasite.model import Batch, forward, forward_logits, init_kv_cache, load_hf


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    model = hf_models.save(family, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 37))
    ours = forward_logits(params, config, jnp.asarray(ids))
    assert rel_err(ours, torch_logits(model, ids)) <= 1e-4


def test_sharded_checkpoint(tmp_path):
    model = hf_models.save("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    ids = np.arange(20)[None] % config.vocab_size
    assert rel_err(forward_logits(params, config, jnp.asarray(ids)), torch_logits(model, ids)) <= 1e-4


def test_load_in_bfloat16_from_float32(tmp_path):
    model = hf_models.save("qwen3", tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    ids = np.arange(16)[None]
    assert rel_err(forward_logits(params, config, jnp.asarray(ids)), torch_logits(model, ids)) < 0.05


_jit_forward = jax.jit(forward, static_argnums=1)
_jit_forward_logits = jax.jit(forward_logits, static_argnums=1)


def dense_logits(params, config, ids):
    """forward_logits under jit: eagerly a model compiles op by op, seconds per shape."""
    return _jit_forward_logits(params, config, jnp.asarray(ids))


def paged_step(params, config, kv, chunks, page_tables, page_size, pad_to=None):
    """One ragged step: `chunks` is a list of (seq_id, token_ids, start_position). With
    `pad_to=(tokens, seqs)` the step is padded to that shape and runs under jit, so the steps
    of a plan share one compile (logits rows past the chunks' are the padding's)."""
    tokens, positions, slots, starts, lens, last = [], [], [], [0], [], []
    for seq, ids, start in chunks:
        pos = np.arange(start, start + len(ids))
        pages = page_tables[seq]
        tokens += list(ids)
        positions += list(pos)
        slots += list(pages[pos // page_size] * page_size + pos % page_size)
        starts.append(len(tokens))
        lens.append(start + len(ids))
        last.append(len(tokens) - 1)
    pad = 3  # padding tokens and a padding sequence must not disturb anything
    num_tokens, num_seqs = pad_to or (len(tokens) + pad, len(chunks) + 1)
    pad, pad_seqs = num_tokens - len(tokens), num_seqs - len(chunks)
    assert pad >= 3 and pad_seqs >= 1, (pad, pad_seqs)
    tokens += [0] * pad
    positions += [0] * pad
    slots += [-1] * pad
    starts += [starts[-1]] * pad_seqs
    lens += [0] * pad_seqs
    table = np.stack([page_tables[seq] for seq, _, _ in chunks]
                     + [np.zeros_like(page_tables[0])] * pad_seqs)
    if pad_to:
        last += [num_tokens - 1] * pad_seqs
    batch = Batch(*(jnp.asarray(np.asarray(a, np.int32)) for a in (starts, lens, table, slots, last)))
    return (_jit_forward if pad_to else forward)(
        params, config, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), kv, batch)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_paged_forward_matches_dense(family, tmp_path):
    hf_models.save(family, tmp_path)
    config, params = load_hf(tmp_path, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    page_size, num_pages = 4, 64
    seqs = [rng.integers(0, config.vocab_size, n) for n in (23, 12)]
    dense = [np.asarray(dense_logits(params, config, s[None]))[0] for s in seqs]
    perm = rng.permutation(num_pages)  # pages handed out in random order
    page_tables = [perm[:16], perm[16:32]]
    kv = init_kv_cache(config, num_pages, page_size, jnp.float32)
    # Prefill seq 0 in chunks of 5, 11 and 4 while seq 1 prefills 9 at once, then decode both.
    plan = [[(0, 0, 5), (1, 0, 9)], [(0, 5, 16)], [(0, 16, 20)]]
    plan += [[(0, t, t + 1), (1, t - 11, t - 10)] for t in range(20, 23)]
    for chunks in plan:
        spec = tuple((s, tuple(seqs[s][a:b]), a) for s, a, b in chunks)
        logits, kv = paged_step(params, config, kv, [(s, np.array(ids), a) for s, ids, a in spec],
                                page_tables, page_size, pad_to=(20, 3))
        for (s, _, b), row in zip(chunks, np.asarray(logits)):
            assert rel_err(row, dense[s][b - 1]) <= 1e-4, (s, b)
