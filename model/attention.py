"""Grouped-query attention: projections, q/k norms, RoPE, and the one call into `kernels/`.

Two ways in: dense (`forward_logits`, training) through `kernels.flash_attention`, and paged
(`forward`, serving) where this step's K/V are written into the layer's pages and the whole
ragged batch attends through `kernels.ragged_paged_attention`. A fused projection on that way
gets its RoPE and page write in one call (`kernels.rope_write_kv`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax.numpy as jnp

from .. import kernels
from . import quant
from .config import ModelConfig
from .fuse import QKV
from .layers import (RMSNorm, device_hooks, fused_param, param, rope_frequencies, rope_tables,
                     rotate)


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
    layer: int = 0

    def setup(self):
        c = self.config
        d, h, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        # Serving may hold q/k/v as one weight (`fuse.py`): one product instead of three.
        self.wqkv = fused_param(self, QKV, (d, kv, h // kv + 2, hd))
        if self.wqkv is None:
            self.wq = param(self, "wq", (d, h, hd), ("embed", "heads", "head_dim"), self.dtype)
            self.wk = param(self, "wk", (d, kv, hd), ("embed", "kv_heads", "head_dim"),
                            self.dtype)
            self.wv = param(self, "wv", (d, kv, hd), ("embed", "kv_heads", "head_dim"),
                            self.dtype)
        self.wo = param(self, "wo", (h, hd, d), ("heads", "head_dim", "embed"), self.dtype)
        if c.qkv_bias:
            zeros = nn.initializers.zeros
            self.bq = param(self, "bq", (h, hd), ("heads", "head_dim"), self.dtype, zeros)
            self.bk = param(self, "bk", (kv, hd), ("kv_heads", "head_dim"), self.dtype, zeros)
            self.bv = param(self, "bv", (kv, hd), ("kv_heads", "head_dim"), self.dtype, zeros)
        if c.o_bias:
            self.bo = param(self, "bo", (d,), ("embed",), self.dtype, nn.initializers.zeros)
        if c.sinks:
            self.sinks = param(self, "sinks", (h,), ("heads",), self.dtype, nn.initializers.zeros)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps, self.dtype, "head_dim", c.norm_plus_one)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps, self.dtype, "head_dim", c.norm_plus_one)

    def qkv(self, x, positions, batch: Batch | None = None):
        """x [..., T, D] -> q [..., T, H, hd], k and v [..., T, KV, hd], RoPE applied."""
        c = self.config
        if self.wqkv is None:
            q, k, v = (quant.linear(x, w) for w in (self.wq, self.wk, self.wv))
        else:  # [..., T, kv, g + 2, hd]: each KV head's queries, then its key and value
            y = quant.linear(x, self.wqkv)
            g = y.shape[-2] - 2
            q = y[..., :g, :].reshape(*y.shape[:-3], c.num_heads, c.head_dim)
            k, v = y[..., g, :], y[..., g + 1, :]
        if c.qkv_bias:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope(positions, batch)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def rope(self, positions, batch: Batch | None = None):
        """This layer's RoPE tables (cos, sin) [..., T, rot/2] at `positions`."""
        c = self.config
        theta, scaling = c.rope(self.layer)
        seq_lens = sequence_lengths(positions, batch) if scaling.kind == "longrope" else None
        inv_freq = rope_frequencies(c.rotary_dim or c.head_dim, theta, scaling, seq_lens)
        return rope_tables(positions, inv_freq, scaling.attention_factor)

    def fused_epilogue(self) -> bool:
        """Whether a paged step's q/k norms, RoPE and page write can be one call
        (`attend_projection`): q, k and v are one fused product (plus its bias)."""
        return self.wqkv is not None and not self.is_initializing()

    def epilogue_args(self) -> dict:
        """`kernels.rope_write_kv`'s keywords for this layer: the q/k/v biases (bq [H, D],
        bk, bv [KV, D]) and the q/k norms' weights, where the model has them."""
        c, kw = self.config, {}
        if c.qkv_bias:
            kw["bias"] = (self.bq, self.bk, self.bv)
        if c.qk_norm:
            kw["norm"] = tuple(n.variables["params"]["scale"] for n in (self.q_norm, self.k_norm))
            kw.update(eps=c.rms_norm_eps, plus_one=c.norm_plus_one)
        return kw

    def __call__(self, x, positions, segment_ids=None, layer_cache=None, batch: Batch | None = None,
                 unscaled=False):
        """`unscaled`: an 8-bit output product may come back before its scales (`Product`)."""
        c = self.config
        options = attention_options(c, self.layer)
        # Sinks are per query head: on a mesh they are split with the heads.
        sinks = dict(sinks=self.sinks) if c.sinks else {}
        hooks = device_hooks()
        if layer_cache is not None and hooks is None and self.fused_epilogue():
            y = quant.linear(x, self.wqkv)
            o, layer_cache = attend_projection(y, *self.rope(positions, batch), layer_cache,
                                               batch, self.epilogue_args(), **options, **sinks)
        elif hooks is None:
            q, k, v = self.qkv(x, positions, batch)
            o, layer_cache = attend(q, k, v, segment_ids, layer_cache, batch, **options, **sinks)
        else:  # on a mesh: the kernels run once per shard of heads
            q, k, v = self.qkv(x, positions, batch)
            o, layer_cache = hooks.attention(functools.partial(attend, **options), q, k, v,
                                             segment_ids, layer_cache, batch, **sinks)
        out = quant.linear(o, self.wo, in_axes=2, unscaled=unscaled and not c.o_bias)
        return (out + self.bo if c.o_bias else out), layer_cache


def sequence_lengths(positions, batch: Batch | None):
    """Per token, the length of its sequence after this call: the row's last position + 1
    (dense), or its sequence's context length (a ragged batch). LongRoPE picks its factors by
    it. Keys already in the pages keep the factors they were written with: when a sequence
    first passes the pretraining length, transformers recomputes its whole cache with the long
    factors, a paged cache does not (the two agree again for prompts that start past it)."""
    if batch is None:
        return jnp.broadcast_to(jnp.max(positions, axis=-1, keepdims=True) + 1, positions.shape)
    tokens = jnp.arange(positions.shape[-1])
    seq = jnp.searchsorted(batch.query_start, tokens, side="right") - 1
    return batch.context_lens[jnp.clip(seq, 0, batch.context_lens.shape[0] - 1)]


def attention_options(config: ModelConfig, layer: int) -> dict:
    """The kernels' keyword arguments for `layer`: its window, soft cap and score scale (only
    those that differ from plain causal attention; sinks, a param, come with the call)."""
    options = dict(sliding_window=config.window(layer), logit_softcap=config.attn_logit_softcap)
    if config.query_pre_attn_scalar is not None:
        options["sm_scale"] = config.sm_scale
    return {name: value for name, value in options.items() if value is not None}


def attend(q, k, v, segment_ids=None, layer_cache=None, batch: Batch | None = None,
           **options):
    """The calls into `kernels/`: dense causal attention, or write this step's K/V into the
    layer's pages and attend over them. Works on whatever heads it is given (all, or a shard).
    `options` (sliding_window, logit_softcap, sm_scale, sinks) go to the kernel as they are. A
    layer cache of float8 pages carries their per-KV-head scales after them."""
    D = q.shape[-1]
    width = (layer_cache[0].shape[-1] if layer_cache is not None
             else kernels.pl_next_power_of_2(D))
    q, k, v, options = pad_heads(width, q, k, v, **options)
    if layer_cache is None:
        return kernels.flash_attention(q, k, v, causal=True, segment_ids=segment_ids,
                                       **options)[..., :D], None
    k_pages, v_pages, *scales = layer_cache
    scale_kw = dict(zip(("k_scale", "v_scale"), scales))
    k_pages, v_pages = kernels.write_kv(k_pages, v_pages, k, v, batch.slots, **scale_kw)
    o = kernels.ragged_paged_attention(q, k_pages, v_pages, batch.query_start,
                                       batch.context_lens, batch.page_table, **options,
                                       **scale_kw)
    return o[..., :D], (k_pages, v_pages, *scales)


def pad_heads(width, *xs, **options):
    """xs [..., D] with zeros after D up to `width` (the pages': the kernels tile powers of
    two), and `options` with the score scale of D, which the kernels would otherwise take from
    the width. Zeros in the queries keep each score's value."""
    D = xs[0].shape[-1]
    if width == D:
        return (*xs, options)
    return (*(kernels.reference.pad_last(x, width) for x in xs),
            {"sm_scale": D ** -0.5} | options)


def attend_projection(y, cos, sin, layer_cache, batch: Batch, epilogue=None, **options):
    """The paged way in from a fused projection y [T, KV, G + 2, D] (G queries, the key and the
    value of each kv head, as they come): its bias, q/k norms (`epilogue`: the keywords of
    `Attention.epilogue_args`), RoPE by the tables cos/sin [T, R / 2] and the page write in one
    call (`kernels.rope_write_kv`), then `attend`'s attention call."""
    k_pages, v_pages, *scales = layer_cache
    scale_kw = dict(zip(("k_scale", "v_scale"), scales))
    T, D = y.shape[-4], y.shape[-1]
    q, k_pages, v_pages = kernels.rope_write_kv(
        y.reshape(T, *y.shape[-3:]), k_pages, v_pages, batch.slots, cos.reshape(T, -1),
        sin.reshape(T, -1), **(epilogue or {}), **scale_kw)
    q, options = pad_heads(k_pages.shape[-1], q, **options)
    o = kernels.ragged_paged_attention(q, k_pages, v_pages, batch.query_start,
                                       batch.context_lens, batch.page_table, **options,
                                       **scale_kw)
    return o[..., :D], (k_pages, v_pages, *scales)
