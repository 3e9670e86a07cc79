"""Fused projections for serving: q/k/v stored as one weight, gate/up as one.

One product then reads all of a layer's q/k/v (or gate/up) weights in one pass, instead of one
call per weight: the small k and v products read far below HBM speed on their own, and XLA
merging the bf16 dots itself copies their weights together every step (docs/BENCHMARKS.md).
The layouts keep each KV head's queries beside it, so the split is a slice:

  attn wqkv       [d, kv, g + 2, hd]   per KV head: its g = heads / kv query heads, its key,
                                      its value (query head i = kv head i // g, as GQA has it)
  mlp  w_gate_up  [d, 2, f]            gate, then up

`fuse_params` rewrites a params tree so; `Attention` and `MLP` read either form. Plain
arrays, FP8 QArrays (any stored order or scale blocks) and packed integer weights fuse; a set
whose parts do not line up (act-order permutations that differ, mixed kinds) stays apart.
Placed on one device only: the fused axes do not follow the mesh's head and mlp shardings.
"""

from __future__ import annotations

import jax.numpy as jnp

from .quant import QArray, is_packed, is_quantized

QKV, GATE_UP = "wqkv", "w_gate_up"


def fuse_params(params):
    """Fuse every layer's q/k/v and gate/up where they line up, in place: each layer's parts
    are dropped as its fused weight is made, so the device never holds more than one layer
    twice. Returns `params`."""
    for name, layer in params.items():
        if name.startswith("layers_") and isinstance(layer, dict):
            for part, fuse in (("attn", fuse_attention), ("mlp", fuse_mlp)):
                if isinstance(layer.get(part), dict):
                    layer[part] = fuse(layer[part])
    return params


def fuse_attention(attn: dict) -> dict:
    if not {"wq", "wk", "wv"} <= attn.keys():
        return attn
    wq, wk, wv = attn["wq"], attn["wk"], attn["wv"]
    if len(wq.shape) != 3 or len(wk.shape) != 3:  # not [d, heads, hd] (MLA's are other)
        return attn
    d, h, hd = wq.shape
    kv = wk.shape[1]
    fused = _concat([(wq, (kv, h // kv)), (wk, (kv, 1)), (wv, (kv, 1))], axis=1,
                    shape=(d, kv, h // kv + 2, hd))
    if fused is None:
        return attn
    return {QKV: fused, **{k: v for k, v in attn.items() if k not in ("wq", "wk", "wv")}}


def fuse_mlp(mlp: dict) -> dict:
    if not {"w_gate", "w_up"} <= mlp.keys() or len(mlp["w_gate"].shape) != 2:
        return mlp
    d, f = mlp["w_gate"].shape
    fused = _concat([(mlp["w_gate"], (1, f)), (mlp["w_up"], (1, f))], axis=0, shape=(d, 2, f))
    if fused is None:
        return mlp
    return {GATE_UP: fused, **{k: v for k, v in mlp.items() if k not in ("w_gate", "w_up")}}


class _Mismatch(Exception):
    pass


def _concat(parts, axis: int, shape: tuple):
    """Weights [d, out0, rest...], each with out0 reshaped to its split (a pair), joined along
    the split's `axis`: the fused weight of logical `shape`, or None where the parts are not
    of one kind or do not line up."""
    ws = [w for w, _ in parts]
    splits = [s for _, s in parts]
    try:
        if all(is_quantized(w) for w in ws):
            return _concat_qarray(ws, splits, axis)
        if all(is_packed(w) for w in ws):
            return _concat_packed(ws, splits, axis, shape)
        if not any(is_quantized(w) or is_packed(w) for w in ws):
            return _join(ws, splits, axis, out_at=1)
    except _Mismatch:
        pass
    return None


def _join(arrays, splits, axis: int, out_at: int):
    """Reshape axis `out_at` of each array into its split and concatenate along the split's
    `axis`. An axis shorter than the split's total (the scale of a block of outputs, or of
    the whole tensor) is first repeated out to one entry an output: the same dequantized
    weight, and a scale every part can share the fused axis with."""
    pieces = []
    for a, split in zip(arrays, splits):
        n, full = a.shape[out_at], split[0] * split[1]
        if full % n:
            raise _Mismatch
        a = jnp.repeat(a, full // n, axis=out_at) if n != full else a
        pieces.append(a.reshape(a.shape[:out_at] + tuple(split) + a.shape[out_at + 1:]))
    at = out_at + axis
    if len({p.shape[:at] + p.shape[at + 1:] for p in pieces}) != 1:
        raise _Mismatch
    return jnp.concatenate(pieces, axis=at)


def _concat_qarray(ws, splits, axis: int) -> QArray:
    first = ws[0]
    if any((w.scheme, w.k_last, w.zero is None) != (first.scheme, first.k_last,
                                                     first.zero is None) for w in ws):
        raise _Mismatch
    out_at = 0 if first.k_last else 1  # the first output axis in stored order
    join = lambda arrays: _join(arrays, splits, axis, out_at)
    zero = None if first.zero is None else join([w.zero for w in ws])
    return QArray(join([w.q for w in ws]), join([w.scale for w in ws]), zero, first.scheme,
                  first.k_last)


def _concat_packed(ws, splits, axis: int, shape: tuple):
    """Packed integer weights [rows, N]: columns are independent, so the fused matrix is the
    parts' columns in the fused order; the rows' packing, groups and any act-order permutation
    must agree."""
    first = ws[0]
    key = lambda w: (w.bits, w.group_size, w.in_axes, w.words.shape[0], w.zero is None,
                     w.perm is None)
    if any(key(w) != key(first) or w.layout != "kn" for w in ws):
        raise _Mismatch  # (the Hopper layout is made after fusion, as the engine places them)
    if first.perm is not None and not all(bool(jnp.array_equal(w.perm, first.perm))
                                          for w in ws):
        raise _Mismatch
    rest = [tuple(w.shape[2:]) for w in ws]  # head_dim of q/k/v, nothing for gate/up

    def join(arrays):
        cols = [a.reshape(a.shape[0], *s, *r) for a, s, r in zip(arrays, splits, rest)]
        return jnp.concatenate(cols, axis=1 + axis).reshape(arrays[0].shape[0], -1)

    zero = None if first.zero is None else join([w.zero for w in ws])
    return type(first)(join([w.words for w in ws]), join([w.scale for w in ws]), zero,
                       first.perm, tuple(shape), first.in_axes, first.bits, first.group_size)
