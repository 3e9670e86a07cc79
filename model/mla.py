"""Multi-head latent attention (DeepSeek-V2/V3).

Keys and values come from one latent per token: `kv_lora_rank` dims after `kv_norm`, plus a
RoPE key of `qk_rope_head_dim` dims shared by every head. Head h's key is [latent @ w_uk[h],
k_pe] and its value latent @ w_uv[h].

Two ways in, as in `attention.py`: dense (`forward_logits`) expands the latent into per-head
keys and values and runs causal flash attention; paged (`forward`) stores only the latent and
the RoPE key (the layer's pages are (latent [1, pages, page, kv_lora_rank], rope [1, pages,
page, qk_rope_head_dim])) and attends in the absorbed form: each query is multiplied by w_uk
into the latent space, the latent itself is the value, and the output is multiplied by w_uv
afterwards. All heads then read the same latent, as one kv head of MQA would.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from .. import kernels
from . import quant
from .config import ModelConfig
from .layers import RMSNorm, apply_rope, device_hooks, param, rope_frequencies

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm keep RMSNorm's default


class MLAttention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    layer: int = 0

    def setup(self):
        c, dt = self.config, self.dtype
        d, h, lat = c.hidden_size, c.num_heads, c.kv_lora_rank
        nope, rope, qk = c.qk_nope_head_dim, c.qk_rope_head_dim, c.head_dim
        if c.q_lora_rank:
            self.wq_a = param(self, "wq_a", (d, c.q_lora_rank), ("embed", None), dt)
            self.q_norm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS, dt, None)
            self.wq_b = param(self, "wq_b", (c.q_lora_rank, h, qk), (None, "heads", "head_dim"),
                              dt)
        else:
            self.wq = param(self, "wq", (d, h, qk), ("embed", "heads", "head_dim"), dt)
        self.wkv_a = param(self, "wkv_a", (d, lat + rope), ("embed", None), dt)
        self.kv_norm = RMSNorm(lat, LORA_NORM_EPS, dt, None)
        self.w_uk = param(self, "w_uk", (lat, h, nope), (None, "heads", "head_dim"), dt)
        self.w_uv = param(self, "w_uv", (lat, h, c.v_head_dim), (None, "heads", "head_dim"), dt)
        self.wo = param(self, "wo", (h, c.v_head_dim, d), ("heads", "head_dim", "embed"), dt)

    def __call__(self, x, positions, segment_ids=None, layer_cache=None, batch=None):
        c = self.config
        lat, nope = c.kv_lora_rank, c.qk_nope_head_dim
        if c.q_lora_rank:
            q = quant.linear(self.q_norm(quant.linear(x, self.wq_a)), self.wq_b)
        else:
            q = quant.linear(x, self.wq)
        kv = quant.linear(x, self.wkv_a)
        latent = self.kv_norm(kv[..., :lat])
        theta, scaling = c.rope(self.layer)
        inv_freq = rope_frequencies(c.qk_rope_head_dim, theta, scaling)
        rope = lambda t: apply_rope(t, positions, inv_freq, scaling.attention_factor)
        q_nope, q_pe, k_pe = q[..., :nope], rope(q[..., nope:]), rope(kv[..., None, lat:])
        attend = functools.partial(mla_attend, sm_scale=c.sm_scale)
        args = (q_nope, q_pe, latent, k_pe[..., 0, :], self.w_uk, self.w_uv, segment_ids,
                layer_cache, batch)
        hooks = device_hooks()
        o, layer_cache = attend(*args) if hooks is None else hooks.mla_attention(attend, *args)
        return quant.linear(o, self.wo, in_axes=2), layer_cache


def mla_attend(q_nope, q_pe, latent, k_pe, w_uk, w_uv, segment_ids=None, layer_cache=None,
               batch=None, *, sm_scale):
    """q_nope [..., T, H, nope], q_pe [..., T, H, rope] (RoPE applied), latent [..., T, lat],
    k_pe [..., T, rope], w_uk [lat, H, nope], w_uv [lat, H, v] -> ([..., T, H, v], layer_cache).
    Works on whatever heads it is given (all, or a shard: the latent is the same for all)."""
    if layer_cache is None:
        k_nope = jnp.einsum("...tl,lhn->...thn", latent, w_uk)
        v = jnp.einsum("...tl,lhv->...thv", latent, w_uv)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[..., None, :], q_pe.shape)], -1)
        # The kernels take one head dim, a power of two: zeros pad q, k and v (scores keep
        # their value, the padded output columns are dropped).
        width = 1 << (max(q.shape[-1], v.shape[-1]) - 1).bit_length()
        pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
        o = kernels.flash_attention(pad(q), pad(k), pad(v), causal=True,
                                    segment_ids=segment_ids, sm_scale=sm_scale)
        return o[..., :v.shape[-1]], None
    latent_pages, rope_pages = layer_cache
    latent_pages, rope_pages = kernels.write_kv(latent_pages, rope_pages, latent[:, None],
                                                k_pe[:, None], batch.slots, impl="reference")
    q_lat = jnp.einsum("thn,lhn->thl", q_nope, w_uk)
    o = kernels.mla_attention(q_lat, q_pe, latent_pages, rope_pages, batch.query_start,
                              batch.context_lens, batch.page_table, sm_scale=sm_scale)
    return jnp.einsum("thl,lhv->thv", o, w_uv), (latent_pages, rope_pages)
