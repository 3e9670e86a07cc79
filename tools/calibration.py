"""Calibrated integer weight quantization (jnp, any backend): group-wise fake quantization,
AWQ's per-input-channel scale search, GPTQ's column-wise error compensation and SmoothQuant's
smoothing factors.

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


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def gptq(w, h, *, bits: int, group_size: int, symmetric: bool, damp: float = 0.01):
    """GPTQ: quantize the rows of w [K, N] in order, each row's rounding error spread over the
    rows not yet quantized through the inverse Hessian H = X^T X (its Cholesky factor), group
    parameters taken from the already-updated rows when a group starts.
    Returns (dequantized weight, scale [K/G, N], zero [K/G, N])."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    dead = jnp.diag(h) == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    w = jnp.where(dead[:, None], 0.0, w)
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k)
    # Upper Cholesky factor of H^-1: row i holds the update weights for rows after i.
    hinv = jnp.linalg.cholesky(jnp.linalg.inv(h), upper=True)
    rows = jnp.arange(k)

    def group(g, carry):
        w, q, scales, zeros = carry
        scale, zero = group_params(lax.dynamic_slice_in_dim(w, g * group_size, group_size),
                                   bits, symmetric)

        def row(j, carry):
            w, q = carry
            i = g * group_size + j
            wi = w[i]
            qi = fake_quant(wi, scale, zero, bits)
            err = (wi - qi) / hinv[i, i]
            later = jnp.where(rows > i, hinv[i], 0.0)
            return w - later[:, None] * err[None, :], q.at[i].set(qi)

        w, q = lax.fori_loop(0, group_size, row, (w, q))
        return w, q, scales.at[g].set(scale), zeros.at[g].set(zero)

    groups = k // group_size
    init = (w, jnp.zeros_like(w), jnp.zeros((groups, n)), jnp.zeros((groups, n)))
    _, q, scales, zeros = lax.fori_loop(0, groups, group, init)
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
