"""Flash attention that also returns its log-sum-exp, for merging partial attentions exactly
(ring attention over a sequence split across devices, `sharding/context.py`).

q [B, T, H, D], k/v [B, S, KV, D], q_pos [T] and k_pos [S] int32 global positions ->
o [B, T, H, D] float32 (normalized over the keys given) and lse [B, H, T] float32 (natural log;
NEG_INF for a row that saw no key). Key j is seen by query t when k_pos[j] >= 0 and, if causal,
k_pos[j] <= q_pos[t]: positions rather than a diagonal, because a device's block of a zig-zag
split is two chunks far apart. A key at position -1 is padding.

Two partials over disjoint keys merge as lse = logaddexp(lse1, lse2),
o = o1 exp(lse1 - lse) + o2 exp(lse2 - lse) (`merge_partials`). The kernel reuses the online
softmax tile of `flash.py`; every tile is masked (blocks of a zig-zag split are not monotonic),
and each block of queries visits only the key tiles between its first and last visible one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .flash import LOG2E, online_softmax_step
from .reference import NEG_INF

LN2 = math.log(2.0)


def attention_lse_reference(q, k, v, q_pos, k_pos, *, causal=True, sm_scale=None):
    """The jnp reference: same contract as `flash_attention_lse`."""
    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    k = jnp.repeat(k, H // KV, axis=2).astype(jnp.float32)
    v = jnp.repeat(v, H // KV, axis=2).astype(jnp.float32)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * sm_scale
    mask = jnp.broadcast_to(k_pos[None, :] >= 0, (q.shape[1], k.shape[1]))
    if causal:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhts,bshd->bthd", p / jnp.where(l == 0, 1.0, l), v)
    lse = jnp.where(l[..., 0] == 0, NEG_INF, m[..., 0] + jnp.log(jnp.where(l == 0, 1.0, l))[..., 0])
    return o, lse


def merge_partials(o1, lse1, o2, lse2):
    """Exact merge of two attentions of the same queries over disjoint keys. o [B, T, H, D]
    float32, lse [B, H, T]. Rows that saw no key on either side stay zero."""
    lse = jnp.logaddexp(lse1, lse2)
    w1 = jnp.swapaxes(jnp.exp(lse1 - lse), 1, 2)[..., None]
    w2 = jnp.swapaxes(jnp.exp(lse2 - lse), 1, 2)[..., None]
    return o1 * w1 + o2 * w2, lse


def tile_bounds(q_pos, k_pos, *, causal, block_q, block_k):
    """Per block of queries, the key tiles [lo, hi) that hold every key it can see (tiles of
    padding, or wholly after the block's last query, are skipped), as int32 [T / block_q]."""
    nq, nk = -(-q_pos.shape[0] // block_q), -(-k_pos.shape[0] // block_k)
    qp = jnp.pad(q_pos, (0, nq * block_q - q_pos.shape[0]), constant_values=-1)
    kp = jnp.pad(k_pos, (0, nk * block_k - k_pos.shape[0]), constant_values=-1)
    kp = kp.reshape(nk, block_k)
    kmin = jnp.min(jnp.where(kp >= 0, kp, jnp.iinfo(jnp.int32).max), axis=1)  # [nk]
    seen = jnp.broadcast_to((kp >= 0).any(axis=1)[None, :], (nq, nk))
    if causal:
        seen = seen & (kmin[None, :] <= qp.reshape(nq, block_q).max(axis=1)[:, None])
    any_ = seen.any(axis=1)
    lo = jnp.where(any_, jnp.argmax(seen, axis=1), 0)
    hi = jnp.where(any_, nk - jnp.argmax(seen[:, ::-1], axis=1), 0)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _flash_lse_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, lo_ref, hi_ref, o_ref, lse_ref,
                      *, sm_scale, causal, block_q, block_k):
    T, D = q_ref.shape
    S = k_ref.shape[0]
    qi = pl.program_id(0)
    rows = qi * block_q + jnp.arange(block_q)
    row_ok = rows < T
    q = plgpu.load(q_ref.at[pl.ds(qi * block_q, block_q), :], mask=row_ok[:, None], other=0.0)
    qpos = plgpu.load(qpos_ref.at[pl.ds(qi * block_q, block_q)], mask=row_ok, other=-1)
    scale = sm_scale * LOG2E

    def tile(j, carry):
        cols = j * block_k + jnp.arange(block_k)
        col_ok = cols < S
        k = plgpu.load(k_ref.at[pl.ds(j * block_k, block_k), :], mask=col_ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(j * block_k, block_k), :], mask=col_ok[:, None], other=0.0)
        kpos = plgpu.load(kpos_ref.at[pl.ds(j * block_k, block_k)], mask=col_ok, other=-1)
        mask = jnp.broadcast_to((kpos >= 0)[None, :], (block_q, block_k))
        if causal:
            mask = mask & (kpos[None, :] <= qpos[:, None])
        s = plgpu.dot(q, k, trans_b=True) * scale
        return online_softmax_step(s, mask, v, carry)

    carry = (jnp.zeros((block_q, D), jnp.float32),
             jnp.full((block_q,), NEG_INF, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    o, m, l = lax.fori_loop(lo_ref[qi], hi_ref[qi], tile, carry)
    empty = l == 0.0
    o = o / jnp.where(empty, 1.0, l)[:, None]
    lse = jnp.where(empty, NEG_INF, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
    plgpu.store(o_ref.at[pl.ds(qi * block_q, block_q), :], o, mask=row_ok[:, None])
    plgpu.store(lse_ref.at[pl.ds(qi * block_q, block_q)], lse, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_q", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def _flash_lse_pallas(q, k, v, q_pos, k_pos, *, causal=True, sm_scale=None, block_q=64,
                      block_k=64, num_warps=4, num_stages=2, interpret=False):
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    if H % KV:
        raise ValueError(f"{H=} query heads is not a multiple of {KV=} kv heads")
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two")
    G = H // KV
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    block_q = min(block_q, max(16, pl.next_power_of_2(T)))
    block_k = min(block_k, max(16, pl.next_power_of_2(S)))
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)
    lo, hi = tile_bounds(q_pos, k_pos, causal=causal, block_q=block_q, block_k=block_k)
    kernel = functools.partial(_flash_lse_kernel, sm_scale=sm_scale, causal=causal,
                               block_q=block_q, block_k=block_k)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, block_q), B, H),
        in_specs=[
            pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, h // G, 0)),
            pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, h // G, 0)),
            pl.BlockSpec((T,), lambda i, b, h: (0,)),
            pl.BlockSpec((S,), lambda i, b, h: (0,)),
            pl.BlockSpec(lo.shape, lambda i, b, h: (0,)),
            pl.BlockSpec(hi.shape, lambda i, b, h: (0,)),
        ],
        out_specs=[pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h, 0)),
                   pl.BlockSpec((None, None, T), lambda i, b, h: (b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pallasite_flash_attention_lse",
    )(q, k, v, q_pos, k_pos, lo, hi)


def flash_attention_lse(q, k, v, q_pos, k_pos, *, causal=True, sm_scale=None, impl=None,
                        interpret=False, **blocks):
    """(o float32, lse): the Pallas kernel on GPU (or in interpret mode), else the reference."""
    from . import _use_pallas
    if not _use_pallas(impl, interpret):
        return attention_lse_reference(q, k, v, q_pos, k_pos, causal=causal, sm_scale=sm_scale)
    o, lse = _flash_lse_pallas(q, k, v, q_pos, k_pos, causal=causal, sm_scale=sm_scale,
                               interpret=interpret, **blocks)
    return o, lse
