"""Write a step's new K/V rows into their pages, in place: one launch for K and V.

k/v_pages [KV, P, page_size, D] (float8 V pages keys-last, [KV, P, D, page_size]:
`reference.keys_last`), k/v [T, KV, D], slots [T] (page * page_size + offset; < 0 for
padding tokens, which write nothing). One program per token stores its [KV, D] rows of K and V
at its slot; the pages are aliased to the outputs, so with donated buffers nothing else moves.
The XLA scatter (`reference.write_kv_reference`) is two launches, one per array; which one a
GPU runs is `tuning.params("kv_write")`. On the H100 this kernel, with the stack of K and V
before it, takes 2.9-15.8 us for 1-2048 tokens against 4.9-44.1 us for the scatters
(docs/BENCHMARKS.md, KV write).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .paged import _gather
from .reference import head_scale, keys_last


def _quantize(x, scale, dtype):
    """x [..., KV, D] / scale [KV] in `dtype`, saturated to its finite range (as
    `reference.quantize_kv`)."""
    if scale is None:
        return x.astype(dtype)
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale[:, None], -big, big).astype(dtype)


def _kernel(slots_ref, kv_ref, scale_ref, k_in, v_in, k_out, v_out, *, page_size):
    del k_in, v_in  # the same buffers as k_out, v_out
    t = pl.program_id(0)
    slot = slots_ref[t]
    live = slot >= 0
    slot = jnp.maximum(slot, 0)  # padding: an in-bounds address, the store masked off
    KV, D = kv_ref.shape[2:]
    heads, page, offset, dims = (jnp.arange(KV)[:, None], slot // page_size, slot % page_size,
                                 jnp.arange(D)[None, :])
    at = _gather(heads, page, offset, dims)
    mask = jnp.broadcast_to(live, (KV, D))
    k_scale = v_scale = None
    if scale_ref is not None:
        k_scale, v_scale = scale_ref[0], scale_ref[1]
    plgpu.store(k_out.at[at], _quantize(kv_ref[t, 0], k_scale, k_out.dtype), mask=mask)
    if keys_last(v_out):  # the token's column of each head's [D, page_size] page
        at = _gather(heads, page, dims, offset)
    plgpu.store(v_out.at[at], _quantize(kv_ref[t, 1], v_scale, v_out.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(k_pages, v_pages, k, v, slots, *, k_scale=None, v_scale=None, interpret=False):
    """-> (k_pages, v_pages) with token t's K/V rows at slots[t]. K and V go in stacked: in a
    model step XLA then makes them in one fusion (RoPE on K, V sliced from the projection),
    where apart they were a fusion each. With k_scale/v_scale [KV] float32 the rows are stored
    divided by their head's scale (quantized when the pages are float8)."""
    T, KV, D = k.shape
    whole = lambda *shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
    pages, v_pages_spec = whole(*k_pages.shape), whole(*v_pages.shape)
    n = 4 if k_scale is None else 5  # flat inputs (no scales: no leaf)
    scales = None
    if k_scale is not None:
        scales = jnp.stack([head_scale(x, KV) for x in (k_scale, v_scale)])
    return pl.pallas_call(
        functools.partial(_kernel, page_size=k_pages.shape[2]),
        grid=(T,),
        in_specs=[whole(T), whole(T, 2, KV, D), None if scales is None else whole(2, KV),
                  pages, v_pages_spec],
        out_specs=[pages, v_pages_spec],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={n - 2: 0, n - 1: 1},  # the pages: the last two leaves
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="pallasite_kv_write",
    )(slots.astype(jnp.int32), jnp.stack([k, v], axis=1), scales, k_pages, v_pages)
