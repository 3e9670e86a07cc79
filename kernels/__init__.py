"""Attention kernels and the one place that picks an implementation.

`impl` is "reference" (plain jnp, any backend) or "pallas" (GPU kernels); None picks "pallas" on
GPU and "reference" elsewhere. `PALLASITE_ATTENTION_IMPL` overrides the automatic choice.
"""

from __future__ import annotations

import os

import jax

from . import reference


def choose_impl(impl: str | None = None) -> str:
    impl = impl or os.environ.get("PALLASITE_ATTENTION_IMPL")
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl not in ("reference", "pallas"):
        raise ValueError(f"attention impl {impl!r} is not one of 'reference', 'pallas'")
    return impl


def flash_attention(q, k, v, *, causal=True, segment_ids=None, sm_scale=None, impl=None):
    """Prefill / no-cache attention. q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D]."""
    return reference.attention_reference(q, k, v, causal=causal, segment_ids=segment_ids,
                                         sm_scale=sm_scale)


def paged_attention(q, k_pages, v_pages, context_lens, page_table, *, sm_scale=None, impl=None):
    """Decode attention over paged K/V. q [S, H, D] -> [S, H, D]."""
    return reference.paged_attention_reference(q, k_pages, v_pages, context_lens, page_table,
                                               sm_scale=sm_scale)


def ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens, page_table, *,
                           sm_scale=None, impl=None):
    """Mixed prefill + decode over paged K/V on one flat token axis. q [T, H, D] -> [T, H, D]."""
    return reference.ragged_paged_attention_reference(
        q, k_pages, v_pages, query_start, context_lens, page_table, sm_scale=sm_scale)


def write_kv(k_pages, v_pages, k, v, slots):
    """Scatter this step's K/V [T, KV, D] into the pages at flat slots (-1 = padding)."""
    return reference.write_kv_reference(k_pages, v_pages, k, v, slots)
