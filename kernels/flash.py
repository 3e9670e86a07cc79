"""Flash attention forward (prefill), Pallas with the Triton lowering.

q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D]; causal masks align the last query with the last
key (query t sees keys <= t + S - T), as `reference.attention_reference` does. One program owns
`block_q` query rows of one head and streams K/V in `block_k` tiles with an online softmax in
float32 (base 2, scale folded in). Causal programs run in two loops: the tiles wholly below the
diagonal without any mask, then the few diagonal tiles with it. GQA is an index map (q head h
reads kv head h // (H // KV)); the q heads of one group run on neighbouring programs so their
K/V tiles come from L2. `segment_ids` [B, T] (T == S) keeps packed documents apart.

Options: `sliding_window` W (causal only) starts each program's loop at the first key tile any
of its rows can see, so tiles wholly outside the window are never read; the tiles the window's
edge crosses run masked, like the diagonal ones. `logit_softcap` c caps the scores as
c * tanh(s / c) before the mask; `sinks` [H] (natural-log logits) join each row's denominator
once, after the loop (`finish`).

Lengths need not be multiples of the blocks: loads past the end are masked and rows past the
end are never stored. head_dim must be a power of two (Triton tiles).

What bounds it: on H100 the Triton lowering issues warpgroup MMAs but does not warp-specialize
or overlap the softmax of one tile with the MMAs of the next, so it runs at 0.7x-0.8x cuDNN
(docs/BENCHMARKS.md). On Hopper `flash_mgpu.py` takes the calls it can; this kernel is the
portable path and serves segment ids and any length.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .reference import NEG_INF

LOG2E = math.log2(math.e)


def online_softmax_step(s, mask, v, carry, pv=None):
    """One K/V tile of flash attention. s [R, BK] base-2 logits, mask [R, BK] or None,
    v [BK, D]; carry (o [R, D], m [R], l [R]) float32, o unnormalized. `pv(p, v)` -> [R, D]
    float32 replaces the tensor-core P V (p float32)."""
    o, m, l = carry
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if mask is not None:  # a row with no key yet has m_new == NEG_INF: keep its p at zero
        p = jnp.where(mask, p, 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    pv = pv or (lambda p, v: plgpu.dot(p.astype(v.dtype), v))
    o = alpha[:, None] * o + pv(p, v)
    return o, m_new, l


def scores(q, k, scale, softcap):
    """Base-2 logits of a tile: q k^T times `scale` (natural units), soft-capped if asked."""
    return base2_logits(plgpu.dot(q, k, trans_b=True), scale, softcap)


def base2_logits(s, scale, softcap):
    """Raw scores `s` times `scale`, soft-capped if asked, in base 2."""
    if softcap is None:
        return s * (scale * LOG2E)
    return (softcap * LOG2E) * jnp.tanh(s * scale * (1.0 / softcap))


def finish(o, m, l, sink):
    """The normalized output of an online softmax (carry o, m, l) whose rows also have the
    base-2 logit `sink` (or None) in the denominator; rows with nothing give zeros, and so
    does a sink of NEG_INF. Returns (o, m, l) with the sink folded into m and l."""
    if sink is not None:
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp2(m - m_new)
        extra = jnp.where(sink <= NEG_INF / 2, 0.0, jnp.exp2(sink - m_new))
        o, l, m = o * alpha[:, None], l * alpha + extra, m_new
    return o / jnp.where(l == 0.0, 1.0, l)[:, None], m, l


def _flash_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, sinks_ref, o_ref, *, sm_scale,
                  causal, block_q, block_k, window, softcap):
    T, D = q_ref.shape
    S = k_ref.shape[0]
    qi = pl.num_programs(0) - 1 - pl.program_id(0)  # heaviest causal blocks first
    rows = qi * block_q + jnp.arange(block_q)
    row_ok = rows < T
    q = plgpu.load(q_ref.at[pl.ds(qi * block_q, block_q), :], mask=row_ok[:, None], other=0.0)
    qseg = None
    if qseg_ref is not None:
        qseg = plgpu.load(qseg_ref.at[pl.ds(qi * block_q, block_q)], mask=row_ok, other=-1)

    def tile(j, carry, masked):
        cols = j * block_k + jnp.arange(block_k)
        col_ok = cols < S
        k = plgpu.load(k_ref.at[pl.ds(j * block_k, block_k), :], mask=col_ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(j * block_k, block_k), :], mask=col_ok[:, None], other=0.0)
        s = scores(q, k, sm_scale, softcap)
        mask = None
        if masked:
            mask = col_ok[None, :]
            if causal:
                mask = mask & (cols[None, :] <= rows[:, None] + (S - T))
            if window is not None:
                mask = mask & (cols[None, :] > rows[:, None] + (S - T) - window)
            if qseg is not None:
                kseg = plgpu.load(kseg_ref.at[pl.ds(j * block_k, block_k)], mask=col_ok, other=-2)
                mask = mask & (qseg[:, None] == kseg[None, :])
        return online_softmax_step(s, mask, v, carry)

    # Key tiles [n_lo, n_edge) cross the window's edge and [n_free, n_all) the diagonal: they
    # need a mask; [n_edge, n_free) do not. Tiles before n_lo are outside every row's window.
    first_pos = qi * block_q + (S - T)
    last_key = S if not causal else jnp.minimum(S, first_pos + block_q)
    n_all = pl.cdiv(jnp.maximum(last_key, 0), block_k)
    if qseg_ref is not None:
        n_free = 0
    elif causal:
        n_free = jnp.clip((first_pos + 1) // block_k, 0, S // block_k)
    else:
        n_free = S // block_k
    n_lo = n_edge = 0
    if window is not None:
        n_lo = jnp.clip((first_pos - window + 1) // block_k, 0, n_all)
        n_edge = jnp.clip(pl.cdiv(first_pos + block_q - window, block_k), n_lo, n_all)
    n_free = jnp.clip(n_free, n_edge, n_all)
    carry = (jnp.zeros((block_q, D), jnp.float32),
             jnp.full((block_q,), NEG_INF, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(n_lo, n_edge, functools.partial(tile, masked=True), carry)
    carry = lax.fori_loop(n_edge, n_free, functools.partial(tile, masked=False), carry)
    carry = lax.fori_loop(n_free, n_all, functools.partial(tile, masked=True), carry)
    sink = None if sinks_ref is None else sinks_ref[pl.program_id(2)] * LOG2E
    o, _, _ = finish(*carry, sink)
    plgpu.store(o_ref.at[pl.ds(qi * block_q, block_q), :], o.astype(o_ref.dtype),
                mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=(
    "causal", "sm_scale", "sliding_window", "logit_softcap", "block_q", "block_k", "num_warps",
    "num_stages", "interpret"))
def flash_attention(q, k, v, segment_ids=None, *, causal=True, sm_scale=None,
                    sliding_window=None, logit_softcap=None, sinks=None, block_q=128,
                    block_k=64, num_warps=8, num_stages=3, interpret=False):
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    if H % KV:
        raise ValueError(f"{H=} query heads is not a multiple of {KV=} kv heads")
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ValueError(f"sliding_window {sliding_window} needs causal attention and >= 1")
    if D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two")
    G = H // KV
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    block_q = min(block_q, max(16, pl.next_power_of_2(T)))
    block_k = min(block_k, max(16, pl.next_power_of_2(S)))
    grid = (pl.cdiv(T, block_q), B, H)
    in_specs = [
        pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, h // G, 0)),
        pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, h // G, 0)),
    ]
    args = [q, k, v]
    if segment_ids is not None:
        if T != S:
            raise ValueError("segment_ids need T == S")
        seg = segment_ids.astype(jnp.int32)
        in_specs += [pl.BlockSpec((None, T), lambda i, b, h: (b, 0))] * 2
        args += [seg, seg]
    else:
        in_specs += [None, None]
        args += [None, None]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((H,), lambda i, b, h: (0,)))
        args.append(jnp.asarray(sinks, jnp.float32).reshape(H))
    else:
        in_specs.append(None)
        args.append(None)
    kernel = functools.partial(_flash_kernel, sm_scale=sm_scale, causal=causal,
                               block_q=block_q, block_k=block_k, window=sliding_window,
                               softcap=logit_softcap)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pallasite_flash_attention",
    )(*args)
