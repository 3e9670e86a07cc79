"""Building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU MLP, routed experts.

Every parameter carries logical axis names (embed, vocab, heads, kv_heads, head_dim, mlp,
experts) through `nn.with_logical_partitioning`; `sharding/` maps those names to mesh axes.
Weights are stored [in, out]; compute runs in the dtype of the weights, norms and softmaxes in f32.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import kernels
from . import quant
from .config import ModelConfig, RopeScaling


# -- device hooks --------------------------------------------------------------------------------
# A layer above (sharding/) installs an object here while it traces a step on a device mesh; the
# model then hands it the four things that must know about devices: attention per shard of heads
# (`attention`), the experts' dispatch (`moe`), the embedding lookup (`embed`) and sharding hints
# on activations (`constrain`).
# With none installed the model runs as written on one device. The model never imports that
# layer: it only calls these methods. Installed inside the traced function, so a jit cache never
# mixes traces made with and without it.
_HOOKS = contextvars.ContextVar("pallasite_device_hooks", default=None)


def device_hooks():
    return _HOOKS.get()


@contextlib.contextmanager
def use_device_hooks(hooks):
    token = _HOOKS.set(hooks)
    try:
        yield hooks
    finally:
        _HOOKS.reset(token)


def embed_lookup(table, tokens):
    """Rows of the embedding table for `tokens` (on a mesh, the shards of a split vocabulary
    each look up their own rows)."""
    hooks = _HOOKS.get()
    return table[tokens] if hooks is None else hooks.embed(table, tokens)


def constrain(x, logical_axes: tuple):
    """Hint an activation's sharding by logical axis names (no-op without hooks)."""
    hooks = _HOOKS.get()
    return x if hooks is None else hooks.constrain(x, logical_axes)


def param(module: nn.Module, name: str, shape, axes, dtype, init=None):
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if hasattr(value, "linear"):  # a packed layout (quant_int.PackedInt): not [in, out]
            return value
    init = init or nn.initializers.normal(0.02)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: jnp.dtype
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x):
        scale = param(self, "scale", (self.dim,), (self.axis_name,), self.dtype, nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> jnp.ndarray:
    """Inverse frequencies [head_dim // 2], with linear or Llama-3 scaling applied."""
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old = scaling.original_max_position
        low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, blended, scaled)
    return inv


def apply_rope(x, positions, inv_freq):
    """x [..., T, heads, D], positions [..., T]; rotates the two halves of D (HF convention)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, D/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        c = self.config
        w_gate = param(self, "w_gate", (c.hidden_size, c.intermediate_size), ("embed", "mlp"), self.dtype)
        w_up = param(self, "w_up", (c.hidden_size, c.intermediate_size), ("embed", "mlp"), self.dtype)
        w_down = param(self, "w_down", (c.intermediate_size, c.hidden_size), ("mlp", "embed"), self.dtype)
        h = jax.nn.silu(quant.linear(x, w_gate)) * quant.linear(x, w_up)
        return quant.linear(h, w_down)


def route(x, router, top_k: int, renormalize: bool):
    """Top-k routing as Mixtral and Qwen3-MoE do it: softmax over all experts in f32, keep the
    top k, optionally renormalize them to sum to one. Returns (weights [N, k], experts [N, k])."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def grouped_expert_mlp(x_sorted, group_sizes, w_gate, w_up, w_down):
    """SwiGLU over tokens already sorted by expert: one grouped matmul per projection.
    Quantized experts pass as (values, scales [E, G, F]) pairs: the kernels dequantize them."""
    if quant.is_quantized(w_gate):
        w_gate, w_up, w_down = (quant.grouped_operand(w) for w in (w_gate, w_up, w_down))
    return kernels.grouped_mlp(x_sorted, group_sizes, w_gate, w_up, w_down)


def moe_dispatch_combine(x, weights, experts, num_experts, expert_fn):
    """Exact top-k MoE (no capacity, no dropping): sort the N*k (token, expert) pairs by expert,
    run `expert_fn(x_sorted, group_sizes)`, scatter-add the weighted rows back to their tokens."""
    n, k = experts.shape
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    y = expert_fn(x[token_of], group_sizes)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token_of].add(y)


class MoE(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        c = self.config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        router = param(self, "router", (d, e), ("embed", None), self.dtype)
        w_gate = param(self, "w_gate", (e, d, f), ("experts", "embed", "mlp"), self.dtype)
        w_up = param(self, "w_up", (e, d, f), ("experts", "embed", "mlp"), self.dtype)
        w_down = param(self, "w_down", (e, f, d), ("experts", "mlp", "embed"), self.dtype)
        shape = x.shape
        x = x.reshape(-1, d)
        if (hooks := _HOOKS.get()) is not None:
            return hooks.moe(x, router, w_gate, w_up, w_down).reshape(shape)
        weights, experts = route(x, router, c.num_experts_per_tok, c.norm_topk_prob)
        expert_fn = lambda xs, sizes: grouped_expert_mlp(xs, sizes, w_gate, w_up, w_down)
        return moe_dispatch_combine(x, weights, experts, e, expert_fn).reshape(shape)
