"""Write a step's new K/V rows into their pages, in place: one launch for K and V.

k/v_pages [KV, P, page_size, D], k/v [T, KV, D], slots [T] (page * page_size + offset; < 0 for
padding tokens, which write nothing). One program per token stores its [KV, D] rows of K and V
at its slot; the pages are aliased to the outputs, so with donated buffers nothing else moves.
The XLA scatter (`reference.write_kv_reference`) is two launches, one per array; which one a
GPU runs is `tuning.params("kv_write")` (docs/BENCHMARKS.md, KV write).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .paged import _gather


def _kernel(slots_ref, k_ref, v_ref, k_in, v_in, k_out, v_out, *, page_size):
    del k_in, v_in  # the same buffers as k_out, v_out
    t = pl.program_id(0)
    slot = slots_ref[t]
    live = slot >= 0
    slot = jnp.maximum(slot, 0)  # padding: an in-bounds address, the store masked off
    KV, D = k_ref.shape[1:]
    at = _gather(jnp.arange(KV)[:, None], slot // page_size, slot % page_size,
                 jnp.arange(D)[None, :])
    mask = jnp.broadcast_to(live, (KV, D))
    plgpu.store(k_out.at[at], k_ref[t].astype(k_out.dtype), mask=mask)
    plgpu.store(v_out.at[at], v_ref[t].astype(v_out.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(k_pages, v_pages, k, v, slots, *, interpret=False):
    """-> (k_pages, v_pages) with token t's K/V rows at slots[t]."""
    T, KV, D = k.shape
    whole = lambda *shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
    pages = whole(*k_pages.shape)
    return pl.pallas_call(
        functools.partial(_kernel, page_size=k_pages.shape[2]),
        grid=(T,),
        in_specs=[whole(T), whole(T, KV, D), whole(T, KV, D), pages, pages],
        out_specs=[pages, pages],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="pallasite_kv_write",
    )(slots.astype(jnp.int32), k, v, k_pages, v_pages)
