"""Calibrated integer weight quantization (jnp, any backend): group-wise fake quantization,
AWQ's per-input-channel scale search and clipping search, GPTQ's column-wise error compensation
(in order or in activation order) and SmoothQuant's smoothing factors.

Weights are [K, N] (inputs by outputs, as the params hold them); calibration activations X are
[n, K], the inputs those weights see.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def group_params(w, bits: int, symmetric: bool):
    """Scale and zero (unsigned code of 0) per column of the rows `w` [G, N] of one group."""
    top = 2 ** bits - 1
    if symmetric:
        scale = jnp.max(jnp.abs(w), axis=0) / (2 ** (bits - 1) - 1)
        return jnp.where(scale > 0, scale, 1.0), jnp.full(w.shape[1:], 2.0 ** (bits - 1))
    lo, hi = jnp.minimum(w.min(axis=0), 0), jnp.maximum(w.max(axis=0), 0)
    scale = jnp.where(hi > lo, (hi - lo) / top, 1.0)
    return scale, jnp.clip(jnp.round(-lo / scale), 0, top)


def fake_quant(w, scale, zero, bits: int):
    """Round `w` to the grid and back (the weight the model will compute with)."""
    codes = jnp.clip(jnp.round(w / scale) + zero, 0, 2 ** bits - 1)
    return (codes - zero) * scale


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def rtn(w, *, bits: int, group_size: int, symmetric: bool):
    """Round-to-nearest: (dequantized weight [K, N], scale [K/G, N], zero [K/G, N])."""
    k, n = w.shape
    wg = w.reshape(k // group_size, group_size, n)
    scale, zero = jax.vmap(lambda g: group_params(g, bits, symmetric))(wg)
    deq = jax.vmap(lambda g, s, z: fake_quant(g, s, z, bits))(wg, scale, zero)
    return deq.reshape(k, n), scale, zero


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def _awq_errors(candidates, x, ws, *, bits, group_size, symmetric):
    """The output error of each candidate scale [C, K] over the weights sharing x."""
    want = [x @ w for w in ws]

    def error(s):
        q = [rtn(w * s[:, None], bits=bits, group_size=group_size, symmetric=symmetric)[0]
             for w in ws]
        return sum(jnp.sum(((x / s) @ wq - y) ** 2) for wq, y in zip(q, want))
    return lax.map(error, candidates)


def awq_search(x, ws, *, bits: int, group_size: int, symmetric: bool, grid: int = 20):
    """AWQ: the per-input-channel scale s = mean|x|**alpha (alpha on a grid over [0, 1]) that
    minimizes the output error of (x / s) @ Q(w * s) over the weights `ws` sharing input `x`.
    Returns (s [K], the error at s, the error of plain RTN)."""
    x = x.astype(jnp.float32)
    mag = jnp.maximum(jnp.mean(jnp.abs(x), axis=0), 1e-5)
    alphas = jnp.arange(grid + 1) / grid
    s = mag[None, :] ** alphas[:, None]
    s = s / jnp.sqrt(s.max(axis=1, keepdims=True) * s.min(axis=1, keepdims=True))
    errors = _awq_errors(s, x, list(ws), bits=bits, group_size=group_size, symmetric=symmetric)
    best = int(jnp.argmin(errors))
    return s[best], float(errors[best]), float(errors[0])


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "grid"))
def awq_clip(w, h, *, bits: int, group_size: int, symmetric: bool, grid: int = 20):
    """AWQ's clipping search: for each group of input rows and output column, the bound on |w|
    (a fraction 1, 1 - 1/grid, ... > 1/2 of the group's largest |w|) whose Q(clip(w)) leaves
    the least output error of that group's rows, e^T H_g e with e = Q(clip(w)) - w and H_g the
    group's block of H = X^T X. Clipping a few large weights buys a finer grid for the rest.
    Returns w [K, N] clipped (to be rounded with `rtn`)."""
    k, n = w.shape
    groups = k // group_size
    wg = w.astype(jnp.float32).reshape(groups, group_size, n)
    hg = jnp.moveaxis(jnp.diagonal(h.reshape(groups, group_size, groups, group_size),
                                   axis1=0, axis2=2), -1, 0)  # [groups, G, G]
    top = jnp.max(jnp.abs(wg), axis=1, keepdims=True)

    def clipped(r):
        return jnp.clip(wg, -top * r, top * r)

    def error(r):
        c = clipped(r)
        scale, zero = jax.vmap(lambda g: group_params(g, bits, symmetric))(c)
        e = jax.vmap(lambda g, s, z: fake_quant(g, s, z, bits))(c, scale, zero) - wg
        return jnp.einsum("gin,gij,gjn->gn", e, hg, e)

    ratios = 1.0 - jnp.arange(grid // 2) / grid
    best = ratios[jnp.argmin(lax.map(error, ratios), axis=0)]  # [groups, N]
    return clipped(best[:, None, :]).reshape(k, n)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "act_order"))
def gptq(w, h, *, bits: int, group_size: int, symmetric: bool, act_order: bool = False,
         damp: float = 0.01):
    """GPTQ: quantize the rows of w [K, N] one at a time, each row's rounding error spread over
    the rows not yet quantized through the inverse Hessian H = X^T X (its Cholesky factor).
    In order, a group's parameters come from its already-updated rows when the group starts.
    With `act_order` the rows go in order of falling H diagonal (the inputs that carry the most
    energy first, while the most rows are left to absorb their error) and the groups keep
    their rows, with parameters fixed up front from the weight as given, so the stored form is
    the in-order one (compressed-tensors' actorder "weight").
    Returns (dequantized weight, scale [K/G, N], zero [K/G, N])."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    dead = jnp.diag(h) == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    w = jnp.where(dead[:, None], 0.0, w)
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k)
    groups = k // group_size
    fixed = jax.vmap(lambda g: group_params(g, bits, symmetric))(
        w.reshape(groups, group_size, n))
    perm = jnp.argsort(-jnp.diag(h), stable=True) if act_order else jnp.arange(k)
    w, h = w[perm], h[perm][:, perm]
    # Upper Cholesky factor of H^-1: row i holds the update weights for rows after i.
    hinv = jnp.linalg.cholesky(jnp.linalg.inv(h), upper=True)
    rows = jnp.arange(k)

    def block(b, carry):
        w, q, scales, zeros = carry
        if act_order:  # each row its own group's fixed parameters
            g = lax.dynamic_slice_in_dim(perm, b * group_size, group_size) // group_size
            scale, zero = fixed[0][g], fixed[1][g]
        else:  # one group's parameters, from its rows as updated so far
            scale, zero = group_params(lax.dynamic_slice_in_dim(w, b * group_size, group_size),
                                       bits, symmetric)
            scale, zero = (jnp.broadcast_to(a, (group_size, n)) for a in (scale, zero))

        def row(j, carry):
            w, q = carry
            i = b * group_size + j
            wi = w[i]
            qi = fake_quant(wi, scale[j], zero[j], bits)
            err = (wi - qi) / hinv[i, i]
            later = jnp.where(rows > i, hinv[i], 0.0)
            return w - later[:, None] * err[None, :], q.at[i].set(qi)

        w, q = lax.fori_loop(0, group_size, row, (w, q))
        return w, q, scales.at[b].set(scale[0]), zeros.at[b].set(zero[0])

    init = (w, jnp.zeros_like(w), jnp.zeros((groups, n)), jnp.zeros((groups, n)))
    _, q, scales, zeros = lax.fori_loop(0, groups, block, init)
    if act_order:
        return q[jnp.argsort(perm)], fixed[0], fixed[1]
    return q, scales, zeros


def smoothquant_scales(x, ws, alpha: float = 0.5):
    """SmoothQuant's per-input-channel factors for weights `ws` [K, N] sharing input x [n, K]:
    s_j = max|x_j|**alpha / max|w_j|**(1 - alpha). Dividing x by s (folded into the op before)
    and multiplying the weights' rows by it moves activation outliers into the weights, which
    quantize per output channel."""
    ax = jnp.max(jnp.abs(x), axis=0)
    aw = jnp.max(jnp.stack([jnp.max(jnp.abs(w), axis=1) for w in ws]), axis=0)
    s = ax ** alpha / jnp.maximum(aw, 1e-5) ** (1 - alpha)
    return jnp.where(ax > 0, jnp.maximum(s, 1e-5), 1.0)
