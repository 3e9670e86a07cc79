"""Grouped-query attention: projections, q/k norms, RoPE, and the one call into `kernels/`.

Two ways in: dense (`forward_logits`, training) through `kernels.flash_attention`, and paged
(`forward`, serving) where this step's K/V are written into the layer's pages and the whole
ragged batch attends through `kernels.ragged_paged_attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax.numpy as jnp

from .. import kernels
from . import quant
from .config import ModelConfig
from .layers import RMSNorm, apply_rope, device_hooks, param, rope_frequencies


class Batch(NamedTuple):
    """Per-step metadata of a ragged batch on one flat token axis (all int32).

    query_start [S+1]   cumulative offsets of each sequence's new tokens on the token axis
    context_lens [S]    tokens in each sequence's cache after this step (cached + new)
    page_table [S, P]   page ids of each sequence, in order
    slots [T]           flat KV slot (page * page_size + offset) of each new token, -1 = padding
    logits_indices [N]  tokens whose logits `forward` returns (e.g. each sequence's last)
    """
    query_start: jnp.ndarray
    context_lens: jnp.ndarray
    page_table: jnp.ndarray
    slots: jnp.ndarray
    logits_indices: jnp.ndarray


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    def setup(self):
        c = self.config
        d, h, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.wq = param(self, "wq", (d, h, hd), ("embed", "heads", "head_dim"), self.dtype)
        self.wk = param(self, "wk", (d, kv, hd), ("embed", "kv_heads", "head_dim"), self.dtype)
        self.wv = param(self, "wv", (d, kv, hd), ("embed", "kv_heads", "head_dim"), self.dtype)
        self.wo = param(self, "wo", (h, hd, d), ("heads", "head_dim", "embed"), self.dtype)
        if c.qkv_bias:
            zeros = nn.initializers.zeros
            self.bq = param(self, "bq", (h, hd), ("heads", "head_dim"), self.dtype, zeros)
            self.bk = param(self, "bk", (kv, hd), ("kv_heads", "head_dim"), self.dtype, zeros)
            self.bv = param(self, "bv", (kv, hd), ("kv_heads", "head_dim"), self.dtype, zeros)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps, self.dtype, "head_dim")
            self.k_norm = RMSNorm(hd, c.rms_norm_eps, self.dtype, "head_dim")

    def qkv(self, x, positions):
        """x [..., T, D] -> q [..., T, H, hd], k and v [..., T, KV, hd], RoPE applied."""
        c = self.config
        q, k, v = (quant.linear(x, w) for w in (self.wq, self.wk, self.wv))
        if c.qkv_bias:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x, positions, segment_ids=None, layer_cache=None, batch: Batch | None = None):
        q, k, v = self.qkv(x, positions)
        hooks = device_hooks()
        if hooks is None:
            o, layer_cache = attend(q, k, v, segment_ids, layer_cache, batch)
        else:  # on a mesh: the kernels run once per shard of heads
            o, layer_cache = hooks.attention(attend, q, k, v, segment_ids, layer_cache, batch)
        return quant.linear(o, self.wo, in_axes=2), layer_cache


def attend(q, k, v, segment_ids=None, layer_cache=None, batch: Batch | None = None):
    """The calls into `kernels/`: dense causal attention, or write this step's K/V into the
    layer's pages and attend over them. Works on whatever heads it is given (all, or a shard)."""
    if layer_cache is None:
        return kernels.flash_attention(q, k, v, causal=True, segment_ids=segment_ids), None
    k_pages, v_pages = kernels.write_kv(*layer_cache, k, v, batch.slots)
    o = kernels.ragged_paged_attention(q, k_pages, v_pages, batch.query_start,
                                       batch.context_lens, batch.page_table)
    return o, (k_pages, v_pages)
