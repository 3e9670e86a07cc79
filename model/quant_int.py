"""Integer weight-only quantization (W4A16, W8A16): round-to-nearest quantization of a float
weight into an `IntLinear`, and the kernel's packed arrays from one.
"""

from __future__ import annotations

import numpy as np

from .int_formats import IntLinear


def quantize_rtn(w, *, bits: int = 4, group_size: int = 128, symmetric: bool = True) -> IntLinear:
    """Round-to-nearest: w [K, N] f32 -> codes with a scale (and zero) per group of
    `group_size` rows (-1: per column). Symmetric: scale = max|w| / (2**(bits-1) - 1) and zero
    2**(bits-1); asymmetric: the group's [min, max] mapped onto [0, 2**bits - 1]."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    g = k if group_size in (-1, None) or group_size >= k else group_size
    if k % g:
        raise ValueError(f"quantize: K={k} is not a multiple of group_size={g}")
    wg = w.reshape(k // g, g, n)
    top = 2 ** bits - 1
    if symmetric:
        scale = np.abs(wg).max(axis=1) / (2 ** (bits - 1) - 1)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        zero = np.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
        scale = np.where(hi > lo, (hi - lo) / top, 1.0).astype(np.float32)
        zero = np.clip(np.round(-lo / scale), 0, top)
    codes = np.clip(np.round(wg / scale[:, None]) + zero[:, None], 0, top)
    return IntLinear(codes.reshape(k, n).astype(np.uint8), scale,
                     None if symmetric else zero.astype(np.float32), bits, g)
