"""The fused q/k/v projection's epilogue in one launch: RoPE on the queries and the key, the
queries out, and the key and value into their pages, in place.

y [T, KV, G + 2, D] is the fused projection's output: for each kv head its G queries, its key
and its value (`model/fuse.py`'s order). cos/sin [T, D / 2] float32 are the rotary tables at
each token's position (scaled by the attention factor); they rotate the two halves of D (HF
convention, every head dim). A q/k/v bias, where a model has one (Qwen2, GPT-OSS), comes as
the model holds it, (bq [KV * G, D], bk [KV, D], bv [KV, D]), and is added first. Returns
q [T, KV * G, D] rotated, and the pages with token t's rotated key and its value at slots[t]
(< 0: padding, nothing written). Float8 pages take them divided by their head's scale and
saturated, V keys-last (`reference.keys_last`).

In XLA the same work is three passes a layer: the queries' rotation, the key's rotation
stacked with the value (`kv_write.py` takes them stacked), and the page write. At batch 1 each
is a launch of a few microseconds; at 8192 tokens each reads or writes the projection's rows
again. A program takes `tokens` tokens; kv heads and groups are padded to powers of two and
masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .kv_write import _quantize
from .paged import _gather
from .reference import head_scale, keys_last


def _kernel(slots_ref, cos_ref, sin_ref, scale_ref, bq_ref, bk_ref, bv_ref, y_ref, k_in, v_in,
            q_out, k_out, v_out, *, heads, group, tokens):
    del k_in, v_in  # the same buffers as k_out, v_out
    T, KV, G, D = slots_ref.shape[0], heads, group, y_ref.shape[-1]
    half = D // 2
    # Masked lanes never touch memory on the GPU. In the interpreter a masked store still
    # writes back what it read, so every masked lane's store index is out of bounds (dropped).
    t = pl.program_id(0) * tokens + jnp.arange(tokens)  # [n]
    live_t = t < T
    j = jnp.arange(pl.next_power_of_2(KV))  # kv heads
    s = jnp.arange(pl.next_power_of_2(G))  # queries of a head
    head_ok = j < KV
    lo, hi = jnp.arange(half), half + jnp.arange(half)
    cs = _gather(t[:, None], lo[None, :])
    cos, sin = (plgpu.load(r.at[cs], mask=jnp.broadcast_to(live_t[:, None], cs[0].shape),
                           other=0.0) for r in (cos_ref, sin_ref))  # [n, half]

    def rows(row, mask, cols, b_ref, b_row):  # y's rows and their bias's, float32
        at = _gather(row[..., None], cols)
        x = plgpu.load(y_ref.at[at], mask=jnp.broadcast_to(mask[..., None], at[0].shape),
                       other=0.0)
        if b_ref is not None:  # added in y's dtype, as XLA adds it (b_row: in bounds)
            b = plgpu.load(b_ref.at[_gather(b_row[..., None], cols)])
            x = (x.astype(jnp.float32) + b.astype(jnp.float32)).astype(y_ref.dtype)
        return x.astype(jnp.float32)

    def rotate(row, mask, c, sn, b_ref, b_row):  # -> the two rotated halves, float32
        x1, x2 = (rows(row, mask, cols, b_ref, b_row) for cols in (lo, hi))
        return x1 * c - x2 * sn, x2 * c + x1 * sn

    # y as rows [T * KV * (G + 2), D]: (token, head, i) is row (t * KV + head) * (G + 2) + i,
    # queries at i < G, the key at G, the value at G + 1. Bias rows: bq's head * G + i, bk's
    # and bv's head.
    base = (t[:, None] * KV + j[None, :]) * (G + 2)  # [n, kvp]
    head = jnp.minimum(j, KV - 1)  # padded heads read a real bias row, their stores masked
    q_ok = live_t[:, None, None] & head_ok[None, :, None] & (s < G)[None, None, :]
    q1, q2 = rotate(base[..., None] + s, q_ok, cos[:, None, None, :], sin[:, None, None, :],
                    bq_ref, head[:, None] * G + jnp.minimum(s, G - 1)[None, :])
    q_row = (t[:, None, None] * KV + j[None, :, None]) * G + s[None, None, :]
    q_row = jnp.where(q_ok, q_row, q_out.shape[0])
    q_mask = jnp.broadcast_to(q_ok[..., None], q1.shape)
    for cols, part in ((lo, q1), (hi, q2)):
        plgpu.store(q_out.at[_gather(q_row[..., None], cols)], part.astype(q_out.dtype),
                    mask=q_mask)

    slot = plgpu.load(slots_ref.at[t], mask=live_t, other=-1)
    kv_ok = (slot >= 0)[:, None] & head_ok[None, :]  # [n, kvp]; padding writes nothing
    page_size = k_out.shape[2]
    page = jnp.where(kv_ok, (slot // page_size)[:, None], k_out.shape[1])[..., None]
    offset = (jnp.maximum(slot, 0) % page_size)[:, None, None]
    k_scale = v_scale = None
    if scale_ref is not None:
        k_scale, v_scale = (plgpu.load(scale_ref.at[_gather(jnp.full_like(j, i), j)],
                                       mask=head_ok, other=1.0) for i in (0, 1))
    k1, k2 = rotate(base + G, kv_ok, cos[:, None, :], sin[:, None, :], bk_ref, head)
    heads = j[None, :, None]
    k_mask = jnp.broadcast_to(kv_ok[..., None], k1.shape)
    for cols, part in ((lo, k1), (hi, k2)):  # rounded to y's dtype first, as XLA's RoPE is
        part = part.astype(y_ref.dtype).astype(jnp.float32)
        plgpu.store(k_out.at[_gather(heads, page, offset, cols[None, None, :])],
                    _quantize(part, k_scale, k_out.dtype), mask=k_mask)
    dims = jnp.arange(D)[None, None, :]
    v_mask = jnp.broadcast_to(kv_ok[..., None], kv_ok.shape + (D,))
    v = rows(base + G + 1, kv_ok, jnp.arange(D), bv_ref, head)
    at = (_gather(heads, page, dims, offset) if keys_last(v_out)  # [D, page] pages: a column
          else _gather(heads, page, offset, dims))
    plgpu.store(v_out.at[at], _quantize(v, v_scale, v_out.dtype), mask=v_mask)


@functools.partial(jax.jit, static_argnames=("tokens", "num_warps", "interpret"))
def rope_write_kv(y, k_pages, v_pages, slots, cos, sin, *, bias=None, k_scale=None,
                  v_scale=None, tokens=1, num_warps=4, interpret=False):
    """y [T, KV, G + 2, D], cos/sin [T, D / 2] -> (q [T, KV * G, D], k_pages, v_pages).
    `bias` (bq [KV * G, D], bk [KV, D], bv [KV, D]) is added to y's rows first, in y's dtype."""
    T, KV, G2, D = y.shape
    G = G2 - 2
    if cos.shape != (T, D // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {cos.shape} / {sin.shape} for {T} tokens of head dim {D}: "
                         f"take [T, D / 2]")
    rows = (KV * G, KV, KV)
    if bias is not None and tuple(b.shape for b in bias) != tuple((n, D) for n in rows):
        raise ValueError(f"bias {[b.shape for b in bias]}: take (bq, bk, bv) of "
                         f"{[(n, D) for n in rows]}")
    whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    scales = None
    if k_scale is not None:
        scales = jnp.stack([head_scale(x, KV) for x in (k_scale, v_scale)])
    biases = (None,) * 3 if bias is None else tuple(b.astype(y.dtype) for b in bias)
    pages_at = 4 + (scales is not None) + 3 * (bias is not None)  # flat inputs (None: no leaf)
    q, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, heads=KV, group=G, tokens=tokens),
        grid=(pl.cdiv(T, tokens),),
        in_specs=[whole(T), whole(T, D // 2), whole(T, D // 2),
                  None if scales is None else whole(2, KV),
                  *(None if bias is None else whole(n, D) for n in rows),
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
      *biases, y.reshape(T * KV * G2, D), k_pages, v_pages)
    return q.reshape(T, KV * G, D), k_pages, v_pages
