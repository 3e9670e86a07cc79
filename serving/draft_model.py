"""The draft model of speculative decoding: a small decoder run over ragged batches like the
target, with a K/V cache of its own shape addressed by the target's page tables.

Its pages are the target's page ids (one allocator, one table per sequence), so a page freed,
shared from the prefix cache or rolled back is so for both models at once. Each call runs one
ragged batch of pieces (tokens from a start position) and returns the argmax after each piece's
last token. Shapes come from the same kind of buckets as the engine's, all compiled in warmup().
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..model import Batch, forward, init_kv_cache
from .settings import compiler_options


def layout(T: int, S: int, P: int) -> dict[str, int]:
    """The draft step's int32 input; the page table first, as `batch.int_layout` says why."""
    return dict(page_table=S * P, tokens=T, positions=T, kv_slots=T, query_start=S + 1,
                context_lens=S, logits_indices=S)


class DraftModel:
    def __init__(self, config, params, pages, *, max_num_seqs: int, token_buckets, page_buckets):
        self.config, self.params, self.pages = config, params, pages
        self.max_num_seqs = max_num_seqs
        self.token_buckets = sorted({max(2, b) for b in token_buckets})
        self.page_buckets = sorted(page_buckets)
        dtype = jax.tree.leaves(params)[0].dtype
        self.kv = init_kv_cache(config, pages.num_pages, pages.page_size, dtype)
        self._exe: dict = {}
        self.compilations = 0

    def _fn(self, params, kv, ints, *, shape):
        T, S, P = shape
        table, tok, pos, slot, qstart, ctx, last = jnp.split(
            ints, np.cumsum(list(layout(T, S, P).values()))[:-1])
        logits, kv = forward(params, self.config, tok, pos, kv,
                             Batch(qstart, ctx, table.reshape(S, P), slot, last))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv

    def _compile(self, key):
        T, P = key
        S = min(T, self.max_num_seqs)
        fn = jax.jit(partial(self._fn, shape=(T, S, P)), donate_argnums=1)
        n = sum(layout(T, S, P).values())
        lowered = fn.lower(self.params, self.kv, jax.ShapeDtypeStruct((n,), jnp.int32))
        self._exe[key] = lowered.compile(compiler_options(T))
        self.compilations += 1
        return self._exe[key]

    def keys(self):
        return [(T, P) for T in self.token_buckets for P in self.page_buckets]

    def warmup(self):
        for key in self.keys():
            if key not in self._exe:
                self._compile(key)
        return self

    def run(self, pieces) -> np.ndarray:
        """pieces: (tokens, start position, sequence id) each, written into the sequence's
        pages at positions start.. -> the argmax after each piece's last token [len(pieces)]."""
        ps, n = self.pages.page_size, sum(len(t) for t, _, _ in pieces)
        tables = [self.pages.table(rid) for _, _, rid in pieces]
        widest = max(self.pages.pages_for(s + len(t)) for t, s, _ in pieces)
        T = next(b for b in self.token_buckets if b >= max(n, len(pieces)))
        P = next(b for b in self.page_buckets if b >= widest)
        S = min(T, self.max_num_seqs)
        tok, pos, slot = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32)
        qstart, ctx, last = np.zeros(S + 1, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32)
        table, at = np.zeros((S, P), np.int32), 0
        for i, ((tokens, start, _), pages) in enumerate(zip(pieces, tables)):
            m, end = len(tokens), start + len(tokens)
            used = np.asarray(pages[:self.pages.pages_for(end)], np.int32)
            p = np.arange(start, end)
            tok[at:at + m], pos[at:at + m] = tokens, p
            slot[at:at + m] = used[p // ps] * ps + p % ps
            table[i, :len(used)] = np.maximum(used, 0)  # pages behind the window: 0
            at += m
            qstart[i + 1:] = at
            ctx[i], last[i] = end, at - 1
        exe = self._exe.get((T, P)) or self._compile((T, P))
        out, self.kv = exe(self.params, self.kv,
                           np.concatenate([table.ravel(), tok, pos, slot, qstart, ctx, last]))
        return np.asarray(out)[:len(pieces)]
