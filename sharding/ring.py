"""Ring attention over a sequence split across the devices of one mesh axis.

The sequence (padded to a multiple of 2N) is cut into 2N chunks; device i holds chunks i and
2N-1-i ("zig-zag"), so under a causal mask every device has the same work. Each of N steps
attends the local queries to the K/V block in hand (the flash kernel with log-sum-exp,
`kernels/flash_lse.py`), merges the partial exactly, and passes the block on to the next device
with `ppermute`; the send of the next block is issued before the step's compute so the two
overlap. Off the diagonal a causal step needs only half of the pairs: the block from a device
j < i is wholly before both local chunks on its first chunk and wholly after them on its second,
so the step attends all local queries to its first chunk; from j > i only the second local
chunk sees anything, and it sees the whole block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels.flash_lse import flash_attention_lse, merge_partials
from ..kernels.reference import NEG_INF


def zigzag_order(length: int, n: int) -> np.ndarray:
    """Indices into a sequence of `length` (a multiple of 2n) that lay it out device after
    device, device i holding chunks i and 2n-1-i."""
    if length % (2 * n):
        raise ValueError(f"sequence length {length} must be a multiple of 2 x cp = {2 * n}")
    c = length // (2 * n)
    chunks = np.arange(length).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def zigzag_positions(device, n: int, chunk: int):
    """Global positions [2 * chunk] of the tokens device `device` (traced or int) holds."""
    ar = jnp.arange(chunk, dtype=jnp.int32)
    return jnp.concatenate([device * chunk + ar, (2 * n - 1 - device) * chunk + ar])


def ring_attention(q, k, v, *, axis: str, n: int, causal: bool = True, kv_len=None, sm_scale=None,
                   attend=flash_attention_lse, prefix=None):
    """Inside `shard_map` over `axis` (of size n): q [B, 2c, H, D], k/v [B, 2c, KV, D] this device's
    zig-zag block -> (o [B, 2c, H, D] float32, lse [B, H, 2c]). Keys at positions >= kv_len are
    padding. `prefix`: an optional (o, lse) partial over keys before the sequence (a cached
    prefix), merged in. attend(q, k, v, q_pos, k_pos, causal=, sm_scale=) -> (o, lse)."""
    i = jax.lax.axis_index(axis)
    c = q.shape[1] // 2
    q_pos = zigzag_positions(i, n, c)

    def k_positions(j):
        pos = zigzag_positions(j, n, c)
        return pos if kv_len is None else jnp.where(pos < kv_len, pos, -1)

    def full(k, v, k_pos):
        return attend(q, k, v, q_pos, k_pos, causal=causal, sm_scale=sm_scale)

    def first_keys(k, v, k_pos):  # j < i: every local query sees the block's first chunk only
        return attend(q, k[:, :c], v[:, :c], q_pos, k_pos[:c], causal=causal, sm_scale=sm_scale)

    def last_queries(k, v, k_pos):  # j > i: only the second local chunk sees anything
        o, lse = attend(q[:, c:], k, v, q_pos[c:], k_pos, causal=causal, sm_scale=sm_scale)
        o = jnp.concatenate([jnp.zeros_like(o), o], axis=1)
        return o, jnp.concatenate([jnp.full_like(lse, NEG_INF), lse], axis=2)

    perm = [(d, (d + 1) % n) for d in range(n)]
    o, lse = full(k, v, k_positions(i))  # the diagonal block
    if prefix is not None:
        o, lse = merge_partials(*prefix, o, lse)
    for step in range(1, n):
        k, v = jax.lax.ppermute((k, v), axis, perm) if step == 1 else (k_next, v_next)
        if step < n - 1:  # issued before this step's compute, so the two overlap
            k_next, v_next = jax.lax.ppermute((k, v), axis, perm)
        j = (i - step) % n
        k_pos = k_positions(j)
        if causal:
            part = jax.lax.cond(j < i, first_keys, last_queries, k, v, k_pos)
        else:
            part = full(k, v, k_pos)
        o, lse = merge_partials(o, lse, *part)
    return o, lse
