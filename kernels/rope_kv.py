"""The fused q/k/v projection's epilogue in one launch: the q/k norms and RoPE on the queries
and the key, the queries out, and the key and value into their pages, in place.

y [T, KV, G + 2, D] is the fused projection's output: for each kv head its G queries, its key
and its value (`model/fuse.py`'s order). cos/sin [T, R / 2] float32 are the rotary tables at
each token's position (scaled by the attention factor); they rotate the two halves of a head's
leading R columns (HF convention) and pass the rest over (a partial rotary, Phi-3). A q/k/v
bias, where a model has one (Qwen2, GPT-OSS), comes as the model holds it, (bq [KV * G, D],
bk [KV, D], bv [KV, D]), and is added first; q/k RMSNorm weights [D], where the model has them
(Qwen3, Gemma 3), normalize each query and key head before RoPE. Returns q [T, KV * G, D]
rotated, and the pages with token t's rotated key and its value at slots[t] (< 0: padding,
nothing written; pages wider than D take zeros after it). Float8 pages take them divided by
their head's scale and saturated, V keys-last (`reference.keys_last`).

In XLA the same work is three passes a layer: the queries' norm and rotation, the key's
stacked with the value (`kv_write.py` takes them stacked), and the page write. At batch 1 each
is a launch of a few microseconds; at 8192 tokens each reads or writes the projection's rows
again. A program takes `tokens` tokens; kv heads, groups and a head's column ranges are padded
to powers of two (Triton's ranges) and masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .kv_write import _quantize
from .paged import _gather
from .reference import head_scale, keys_last


def _lanes(start, n):
    """Columns start .. start + n - 1 on a power-of-two range (Triton's), and which are real
    (True: all, a power of two)."""
    c = jnp.arange(pl.next_power_of_2(n))
    if pl.next_power_of_2(n) == n:
        return start + c, True
    return start + jnp.minimum(c, n - 1), c < n


def _both(a, b):
    """a & b, where either may be True (nothing masked: no instruction)."""
    return a if b is True else b if a is True else a & b


def _load(ref, idx, mask, other=0.0):
    idx = _gather(*idx)
    if mask is True:
        return plgpu.load(ref.at[idx])
    return plgpu.load(ref.at[idx], mask=jnp.broadcast_to(mask, idx[0].shape), other=other)


def _store(ref, idx, value, mask):
    """A masked store. In the interpreter a masked lane still writes back what it read, so a
    masked lane's first index is moved past the end (dropped); on the GPU it touches nothing."""
    idx = _gather(*idx)
    mask = jnp.broadcast_to(mask, idx[0].shape)
    plgpu.store(ref.at[(jnp.where(mask, idx[0], ref.shape[0]), *idx[1:])], value, mask=mask)


def _kernel(slots_ref, cos_ref, sin_ref, scale_ref, bq_ref, bk_ref, bv_ref, qn_ref, kn_ref,
            y_ref, k_in, v_in, q_out, k_out, v_out, *, heads, group, tokens, eps, plus_one):
    del k_in, v_in  # the same buffers as k_out, v_out
    T, KV, G, D = slots_ref.shape[0], heads, group, y_ref.shape[-1]
    half, dtype = cos_ref.shape[1], y_ref.dtype
    # A head's columns in parts: the two rotated halves, then those RoPE passes over.
    parts = [_lanes(0, half), _lanes(half, half)]
    if 2 * half < D:
        parts.append(_lanes(2 * half, D - 2 * half))
    t = pl.program_id(0) * tokens + jnp.arange(tokens)  # [n]
    live_t = t < T
    j = jnp.arange(pl.next_power_of_2(KV))  # kv heads
    s = jnp.arange(pl.next_power_of_2(G))  # queries of a head
    head_ok = j < KV
    lo, lo_ok = parts[0]
    cos, sin = (_load(r, (t[:, None], lo[None, :]), _both(live_t[:, None], lo_ok))
                for r in (cos_ref, sin_ref))  # [n, half]

    def rows(row, mask, b_ref, b_row, parts=parts):  # y's rows by part, bias added; float32
        out = []
        for cols, ok in parts:
            x = _load(y_ref, (row[..., None], cols), _both(mask[..., None], ok))
            if b_ref is not None:  # b_row: in bounds
                b = _load(b_ref, (b_row[..., None], cols), ok)
                x = (x.astype(jnp.float32) + b.astype(jnp.float32)).astype(dtype)
            out.append(x.astype(jnp.float32))
        return out

    def norm(xs, w_ref):  # the model's q/k RMSNorm over the head, rounded as it rounds
        if w_ref is None:
            return xs
        r = lax.rsqrt(sum(jnp.sum(x * x, axis=-1, keepdims=True) for x in xs) / D + eps)
        out = []
        for x, (cols, ok) in zip(xs, parts):
            w = _load(w_ref, (cols,), ok).astype(jnp.float32)
            x = ((x * r) * (1.0 + w) if plus_one else w * (x * r).astype(dtype).astype(jnp.float32))
            out.append(x.astype(dtype).astype(jnp.float32))
        return out

    def rope(xs, c, sn):  # the first two parts turn; float32, rounded to y's dtype
        x1, x2, *rest = xs
        return [p.astype(dtype) for p in (x1 * c - x2 * sn, x2 * c + x1 * sn, *rest)]

    # y as rows [T * KV * (G + 2), D]: (token, head, i) is row (t * KV + head) * (G + 2) + i,
    # queries at i < G, the key at G, the value at G + 1. Bias rows: bq's head * G + i, bk's
    # and bv's head.
    base = (t[:, None] * KV + j[None, :]) * (G + 2)  # [n, kvp]
    head = jnp.minimum(j, KV - 1)  # padded heads read a real bias row, their stores masked
    q_ok = live_t[:, None, None] & head_ok[None, :, None] & (s < G)[None, None, :]
    q = rope(norm(rows(base[..., None] + s, q_ok, bq_ref,
                       head[:, None] * G + jnp.minimum(s, G - 1)[None, :]), qn_ref),
             cos[:, None, None, :], sin[:, None, None, :])
    q_row = ((t[:, None, None] * KV + j[None, :, None]) * G + s[None, None, :])[..., None]
    for (cols, ok), part in zip(parts, q):
        _store(q_out, (q_row, cols), part, _both(q_ok[..., None], ok))

    slot = plgpu.load(slots_ref.at[t], mask=live_t, other=-1)
    kv_ok = (slot >= 0)[:, None] & head_ok[None, :]  # [n, kvp]; padding writes nothing
    page_size = k_out.shape[2]
    page = (jnp.maximum(slot, 0) // page_size)[:, None, None]
    offset = (jnp.maximum(slot, 0) % page_size)[:, None, None]
    k_scale = v_scale = None
    if scale_ref is not None:
        k_scale, v_scale = (_load(scale_ref, (jnp.full_like(j, i), j), head_ok, 1.0)
                            for i in (0, 1))
    k = rope(norm(rows(base + G, kv_ok, bk_ref, head), kn_ref), cos[:, None, :], sin[:, None, :])
    v_parts = [_lanes(0, D)]  # the value whole: no rotation
    v = rows(base + G + 1, kv_ok, bv_ref, head, v_parts)
    W = k_out.shape[-1]
    if W > D:  # pages wider than the head (`ModelConfig.page_head_dim`): zeros after it
        pad = _lanes(D, W - D)
        zeros = jnp.zeros(kv_ok.shape + pad[0].shape, jnp.float32)
        parts, v_parts, k, v = parts + [pad], v_parts + [pad], k + [zeros], v + [zeros]
    heads = j[None, :, None]
    for (cols, ok), part in zip(parts, k):
        _store(k_out, (heads, page, offset, cols), _quantize(part.astype(jnp.float32), k_scale,
                                                             k_out.dtype),
               _both(kv_ok[..., None], ok))
    for (cols, ok), part in zip(v_parts, v):
        at = ((heads, page, cols, offset) if keys_last(v_out)  # [D, page] pages: a column
              else (heads, page, offset, cols))
        _store(v_out, at, _quantize(part, v_scale, v_out.dtype), _both(kv_ok[..., None], ok))


@functools.partial(jax.jit, static_argnames=("eps", "plus_one", "tokens", "num_warps",
                                             "interpret"))
def rope_write_kv(y, k_pages, v_pages, slots, cos, sin, *, bias=None, norm=None, eps=1e-6,
                  plus_one=False, k_scale=None, v_scale=None, tokens=1, num_warps=4,
                  interpret=False):
    """y [T, KV, G + 2, D], cos/sin [T, R / 2] (R <= D: the rotated columns) -> (q
    [T, KV * G, D], k_pages, v_pages). `bias` (bq [KV * G, D], bk [KV, D], bv [KV, D]) is added
    to y's rows first, in y's dtype; `norm` (q's and k's RMSNorm weights [D], with `eps` and
    `plus_one` as `reference.rms_norm` takes them) then normalizes each query and key head."""
    T, KV, G2, D = y.shape
    G, half = G2 - 2, cos.shape[-1]
    if cos.shape != (T, half) or sin.shape != cos.shape or not 0 < 2 * half <= D:
        raise ValueError(f"cos/sin {cos.shape} / {sin.shape} for {T} tokens of head dim {D}: "
                         f"take [T, R / 2], 0 < R <= D")
    rows = (KV * G, KV, KV)
    if bias is not None and tuple(b.shape for b in bias) != tuple((n, D) for n in rows):
        raise ValueError(f"bias {[b.shape for b in bias]}: take (bq, bk, bv) of "
                         f"{[(n, D) for n in rows]}")
    if norm is not None and tuple(w.shape for w in norm) != ((D,), (D,)):
        raise ValueError(f"norm {[w.shape for w in norm]}: take (q's, k's) weights of ({D},)")
    whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    scales = None
    if k_scale is not None:
        scales = jnp.stack([head_scale(x, KV) for x in (k_scale, v_scale)])
    biases = (None,) * 3 if bias is None else tuple(b.astype(y.dtype) for b in bias)
    norms = (None,) * 2 if norm is None else tuple(norm)
    # flat inputs before the pages (None: no leaf)
    pages_at = 4 + (scales is not None) + 3 * (bias is not None) + 2 * (norm is not None)
    q, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, heads=KV, group=G, tokens=tokens, eps=eps, plus_one=plus_one),
        grid=(pl.cdiv(T, tokens),),
        in_specs=[whole(T), whole(T, half), whole(T, half),
                  None if scales is None else whole(2, KV),
                  *(None if bias is None else whole(n, D) for n in rows),
                  *(None if norm is None else whole(D) for _ in range(2)),
                  whole(T * KV * G2, D), whole(*k_pages.shape), whole(*v_pages.shape)],
        out_specs=[whole(T * KV * G, D), whole(*k_pages.shape), whole(*v_pages.shape)],
        out_shape=[jax.ShapeDtypeStruct((T * KV * G, D), y.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={pages_at: 1, pages_at + 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="pallasite_rope_write_kv",
    )(slots.astype(jnp.int32), cos.astype(jnp.float32), sin.astype(jnp.float32), scales,
      *biases, *norms, y.reshape(T * KV * G2, D), k_pages, v_pages)
    return q.reshape(T, KV * G, D), k_pages, v_pages
