"""The decoder and its two pure entry points.

Params are a plain pytree: {embed, layers_0 … layers_{L-1}, final_norm, lm_head (untied only)}.
Layers are unrolled rather than scanned so that each layer's weights and KV pages are separate
buffers: the paged step then updates each layer's pages in place with no slicing copies.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import kernels
from ..kernels.quant_reference import Product, value
from .attention import Attention, Batch
from .config import ModelConfig
from . import quant
from .fuse import GATE_UP, QKV
from .layers import MLP, MoE, RMSNorm, constrain, device_hooks, embed_lookup, param
from .mla import MLAttention


class Block(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, segment_ids=None, layer_cache=None, batch=None, h=None):
        """The residual stream x + h in (h: the last layer's output not yet added, or None);
        (x, h, layer_cache) out, the same way. In the paged step on one device each norm adds
        the output before it in its own pass (`kernels.add_norm`), and an 8-bit product may
        come to it before its scales (`Product`, `kernels.norm_quantize`)."""
        c = self.config
        norm = lambda name: RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype,
                                    plus_one=c.norm_plus_one, name=name)
        moe = c.layer_is_moe(self.layer)
        attn_w = self.weights("attn", QKV, "wq", "wk", "wv")
        mlp_w = [] if moe else self.weights("mlp", GATE_UP, "w_gate", "w_up")
        attn_rows8, mlp_rows8 = (self.rows8_of(x, w) for w in (attn_w, mlp_w))
        # Quantized products are Pallas kernels or cuBLASLt's 8-bit GEMMs, which take no
        # prologue or epilogue from XLA: the norms then add and scale in one pass each. Plain
        # bf16 products keep XLA's way, which folds the add into the GEMM before (cuBLAS's
        # C input) and the norm's scaling into the one after (`profile_step`, add_norm).
        one_pass = (layer_cache is not None and device_hooks() is None
                    and kernels.one_pass_norms() and quant.all_quantized(attn_w))
        attn_in, x = pre_norm(norm("attn_norm"), x, h, attn_rows8, one_pass)
        attention = MLAttention if c.is_mla else Attention
        hold = not c.sandwich_norms  # Gemma normalizes each sublayer's output first
        held = dict(unscaled=True) if hold and mlp_rows8 is not None else {}
        h, layer_cache = attention(c, self.dtype, self.layer, name="attn")(
            attn_in, positions, segment_ids, layer_cache, batch, **held)
        if c.sandwich_norms:
            h = norm("attn_post_norm")(h)
        mlp_in, x = pre_norm(norm("mlp_norm"), x, h, mlp_rows8, one_pass)
        ffn = MoE(c, self.dtype, name="moe") if moe else MLP(c, self.dtype, name="mlp")
        held = dict(unscaled=True) if hold and not moe and attn_rows8 is not None else {}
        h = ffn(mlp_in, **held)
        if c.sandwich_norms:
            h = norm("mlp_post_norm")(h)
        if one_pass or isinstance(h, Product):  # the next layer's norm adds it
            return x, h, layer_cache
        return x + h, None, layer_cache

    def weights(self, sublayer, *names):
        """The sublayer's params `names` that exist (none before init)."""
        params = self.variables.get("params", {}).get(sublayer, {})
        return [params[n] for n in names if n in params]

    def rows8_of(self, x, weights):
        """The 8-bit dtype a sublayer's first products (`weights`) all quantize their input's
        rows to (`quant.rows8_for`), or None. Only on one device: a mesh's products run where
        GSPMD places them."""
        if device_hooks() is not None or self.config.is_mla:
            return None
        return quant.rows8_for(x, *weights)


def pre_norm(norm, x, h, rows8, one_pass):
    """(a sublayer's input, the stream x + h): `norm`'s output, quantized per row for 8-bit
    products where `rows8` names their dtype; the sum made in the norm's pass if `one_pass`
    or `rows8`, by XLA before it otherwise."""
    if rows8 is None and not one_pass:
        x = residual_sum(x, h)
        return norm(x), x
    out, total = norm(x, residual=h, rows8=rows8, one_pass=True)
    return out, (x if total is None else total)


def residual_sum(x, h):
    """x + h, for an h that may be held back (None) or a product before its scales."""
    return x if h is None else x + value(h)


class Decoder(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.config
        self.embed = param(self, "embed", (c.vocab_size, c.hidden_size), ("vocab", "embed"), self.dtype)
        self.layers = [Block(c, self.dtype, i, name=f"layers_{i}") for i in range(c.num_layers)]
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype,
                                  plus_one=c.norm_plus_one)
        if not c.tie_word_embeddings:
            self.lm_head = param(self, "lm_head", (c.hidden_size, c.vocab_size), ("embed", "vocab"),
                                 self.dtype)

    def logits(self, x):
        x = self.final_norm(x)
        tied = self.config.tie_word_embeddings
        # float32 out of the accumulator: bf16 logits tie within 2^-8 of their size, and a tie
        # broken by rounding differs between step shapes (e.g. speculative verify vs decode).
        logits = kernels.matmul(x, self.embed if tied else self.lm_head,
                                layout="nk" if tied else "kn", out_dtype=jnp.float32)
        if cap := self.config.final_logit_softcap:
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def __call__(self, tokens, positions, segment_ids=None, kv_cache=None, batch=None):
        # The residual stream: [batch, length, embed] dense, or [tokens, embed] on a flat batch.
        axes = ("batch", "length", "embed") if tokens.ndim == 2 else ("tokens", "embed")
        x = embed_lookup(self.embed, tokens)
        if self.config.scale_embed:  # Gemma: by sqrt(hidden), rounded to the model dtype first
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        x = constrain(x, axes)
        new_cache, h = [], None
        for i, layer in enumerate(self.layers):
            x, h, layer_cache = layer(x, positions, segment_ids,
                                      None if kv_cache is None else kv_cache[i], batch, h)
            x = constrain(x, axes)
            new_cache.append(layer_cache)
        x = residual_sum(x, h)
        if kv_cache is None:
            return self.logits(x), None
        return self.logits(x[batch.logits_indices]), new_cache


def _dtype_of(params):
    return params["embed"].dtype


def init_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Random params (normal(0.02), norms at one) as a plain pytree of arrays."""
    return nn.unbox(_init(config, dtype, jax.random.key(seed)))


def _init(config, dtype, key):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Decoder(config, dtype).init(key, tokens, tokens)["params"]


def param_shapes(config: ModelConfig, dtype=jnp.float32):
    """Shapes and dtypes of every parameter, without allocating any (`jax.ShapeDtypeStruct`s)."""
    return nn.unbox(jax.eval_shape(lambda: _init(config, dtype, jax.random.key(0))))


def param_logical_axes(config: ModelConfig):
    """A pytree like the params holding each parameter's logical axis names (a PartitionSpec)."""
    boxed = jax.eval_shape(lambda: _init(config, jnp.float32, jax.random.key(0)))
    return nn.get_partition_spec(boxed)


def forward_logits(params, config: ModelConfig, token_ids, positions=None, segment_ids=None):
    """No-cache causal forward. token_ids [B, T] -> float32 logits [B, T, vocab]. With packed
    documents, pass their `segment_ids` [B, T] and per-document `positions` [B, T]."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(token_ids.shape[-1]), token_ids.shape)
    logits, _ = Decoder(config, _dtype_of(params)).apply(
        {"params": params}, token_ids, positions, segment_ids)
    return logits


def forward(params, config: ModelConfig, tokens, positions, kv_cache, batch: Batch):
    """Cached forward over a ragged batch. tokens/positions [T] (flat, padded), kv_cache from
    `init_kv_cache`, batch: `Batch`. Returns (float32 logits [N, vocab] at
    batch.logits_indices, updated kv_cache). Jit it with `config` static and `kv_cache` donated."""
    logits, kv_cache = Decoder(config, _dtype_of(params)).apply(
        {"params": params}, tokens, positions, None, kv_cache, batch)
    return logits, kv_cache


def kv_cache_shape(config: ModelConfig, num_pages: int, page_size: int):
    return (config.num_kv_heads, num_pages, page_size, config.page_head_dim)


def kv_bytes_per_token(config: ModelConfig, dtype) -> int:
    """KV cache bytes one token takes over all layers (MLA: its latent and RoPE key)."""
    return (config.num_layers * config.num_kv_heads * sum(config.kv_arrays)
            * jnp.dtype(dtype).itemsize)


KV_SCALE = 1.0  # the per-KV-head scale of float8 pages (K and V are stored as x / scale)


def kv_layer_cache(full, shape, dtype, dims=None):
    """One layer's cache: (k_pages, v_pages) each `shape` [kv_heads, pages, page, head_dim] in
    `dtype`, or with `dims` (`ModelConfig.kv_arrays`) arrays of those last dims (MLA: latent
    and RoPE key). With a one-byte dtype (float8) V is keys-last, [kv_heads, pages, head_dim,
    page], and (k_scale, v_scale) follow, float32 [kv_heads, 1, 1, 1] (the pages' rank, so they
    shard like the pages). `full(shape, value, dtype)` makes each."""
    dims = dims or (shape[-1], shape[-1])
    if jnp.dtype(dtype).itemsize > 1:
        return tuple(full((*shape[:-1], d), 0, dtype) for d in dims)
    if dims[0] != dims[1]:
        raise ValueError("a float8 KV cache is not supported for multi-head latent attention")
    kv, pages, page, d = shape  # float8 V pages are keys-last (`kernels.reference.keys_last`)
    scale = (kv, 1, 1, 1)
    return (full(shape, 0, dtype), full((kv, pages, d, page), 0, dtype),
            full(scale, KV_SCALE, jnp.float32), full(scale, KV_SCALE, jnp.float32))


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16):
    """A list per layer of (k_pages, v_pages), each [kv_heads, num_pages, page_size, head_dim];
    float8 pages come with their scales (`kv_layer_cache`)."""
    shape = kv_cache_shape(config, num_pages, page_size)
    return [kv_layer_cache(jnp.full, shape, dtype, config.kv_arrays)
            for _ in range(config.num_layers)]
