"""Building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU MLP, routed experts.

Every parameter carries logical axis names (embed, vocab, heads, kv_heads, head_dim, mlp,
experts) through `nn.with_logical_partitioning`; `sharding/` maps those names to mesh axes.
Weights are stored [in, out]; compute runs in the dtype of the weights, norms and softmaxes in f32.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from .. import kernels
from ..kernels.reference import rms_norm, rotate_halves as rotate
from . import quant
from .config import ModelConfig, RopeScaling
from .fuse import GATE_UP


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
        if getattr(value, "k_last", 0):  # an FP8 QArray stored [out, in]: check its own shape
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"param {name} of {module.name}: shape {tuple(value.shape)}, "
                                 f"this config needs {tuple(shape)}")
            return value
    init = init or nn.initializers.normal(0.02)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def fused_param(module: nn.Module, name: str, shape):
    """A fused weight (`fuse.py`) if the params hold one, else None. Never created by init."""
    if not module.has_variable("params", name):
        return None
    value = module.get_variable("params", name)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"param {name} of {module.name}: shape {tuple(value.shape)}, this "
                         f"config needs {tuple(shape)}")
    return value


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: jnp.dtype
    axis_name: str = "embed"
    plus_one: bool = False  # Gemma: scale by (1 + weight), in f32 before the cast back

    @nn.compact
    def __call__(self, x, residual=None, rows8=None, one_pass=False):
        """The norm of x, in x's dtype. `one_pass`: the norm of x + residual and that sum
        ((norm, x + residual or None)), made in one pass (`kernels.add_norm`); with `rows8`
        (an 8-bit dtype, `quant.rows8_for`) the norm comes quantized per row for the W8A8
        products it feeds (`Rows8`, `kernels.norm_quantize`). Neither has a gradient: for
        inference."""
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = param(self, "scale", (self.dim,), (self.axis_name,), self.dtype, init)
        if one_pass or rows8 is not None:
            lead = x.shape[:-1]
            flat = lambda a: None if a is None else a.reshape(-1, self.dim)
            kw = dict(eps=self.eps, plus_one=self.plus_one)
            norm, total = (kernels.add_norm(flat(x), scale, flat(residual), **kw) if rows8 is None
                           else kernels.norm_quantize(flat(x), scale, flat(residual),
                                                      out=rows8, **kw))
            return norm.reshape(*lead, self.dim), (None if total is None
                                                   else total.reshape(x.shape))
        return rms_norm(x, scale, eps=self.eps, plus_one=self.plus_one)


def _yarn(inv, inv_scaled, dim: int, theta: float, s: RopeScaling):
    """Blend per frequency: extrapolate (keep) those that turn more than beta_fast times over the
    pretraining length, interpolate (divide by factor) those under beta_slow, ramp between."""
    def dim_of(rotations):  # the dimension index that turns `rotations` times
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))
    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_scaled * ramp + inv * (1 - ramp)


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling, seq_lens=None) -> jnp.ndarray:
    """Inverse frequencies [dim // 2] of a RoPE over `dim` dims, with the scaling applied.
    LongRoPE picks its short or long set per token by the length of the token's sequence so
    far, `seq_lens` [..., T] (then the result is [..., T, dim // 2]), as transformers picks it
    per forward call by its largest position."""
    exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    inv = 1.0 / theta ** exponent
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inv, inv / scaling.factor, dim, theta, scaling)
    if scaling.kind == "longrope":
        long = (seq_lens > scaling.original_max_position)[..., None]
        factors = jnp.where(long, jnp.asarray(scaling.long_factor, jnp.float32),
                            jnp.asarray(scaling.short_factor, jnp.float32))
        return 1.0 / (factors * theta ** exponent)
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


def rope_tables(positions, inv_freq, attention_factor: float = 1.0):
    """cos and sin [..., T, rot/2] float32 at positions [..., T], scaled by `attention_factor`
    (YaRN, LongRoPE)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x, positions, inv_freq, attention_factor: float = 1.0):
    """x [..., T, heads, D], positions [..., T]: RoPE over the leading 2 * len(inv_freq) dims."""
    return rotate(x, *rope_tables(positions, inv_freq, attention_factor))


def activation(name: str):
    """The gate's nonlinearity: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    return {"silu": jax.nn.silu, "gelu_tanh": partial(jax.nn.gelu, approximate=True)}[name]


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    width: int = 0  # hidden units (0: intermediate_size)

    @nn.compact
    def __call__(self, x, unscaled=False):
        """`unscaled`: an 8-bit down product may come back before its scales (`Product`)."""
        c = self.config
        f = self.width or c.intermediate_size
        w_gate_up = fused_param(self, GATE_UP, (c.hidden_size, 2, f))
        if w_gate_up is None:
            w_gate = param(self, "w_gate", (c.hidden_size, f), ("embed", "mlp"), self.dtype)
            w_up = param(self, "w_up", (c.hidden_size, f), ("embed", "mlp"), self.dtype)
            gate, up = quant.linear(x, w_gate), quant.linear(x, w_up)
        w_down = param(self, "w_down", (f, c.hidden_size), ("mlp", "embed"), self.dtype)
        if w_gate_up is not None:  # serving's fused [d, 2, f] (`fuse.py`): one product
            y = (quant.swiglu_w8a8(x, w_gate_up, w_down, unscaled=unscaled)
                 if c.hidden_act == "silu" else None)
            if y is not None:  # 8-bit weights at W8A8 sizes: SwiGLU fused between the GEMMs
                return y
            y = quant.linear(x, w_gate_up)
            gate, up = y[..., 0, :], y[..., 1, :]
        return quant.linear(activation(c.hidden_act)(gate) * up, w_down, unscaled=unscaled)


def route(x, router, top_k: int, renormalize: bool, router_bias=None):
    """Top-k routing as Mixtral and Qwen3-MoE do it: softmax over all experts in f32, keep the
    top k, optionally renormalize them to sum to one. With a `router_bias` (GPT-OSS): the top k
    of the biased logits, softmax over those k. Returns (weights [N, k], experts [N, k])."""
    if router_bias is not None:
        logits, experts = jax.lax.top_k((x @ router + router_bias).astype(jnp.float32), top_k)
        return jax.nn.softmax(logits, axis=-1).astype(x.dtype), experts
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def route_tokens(config: ModelConfig, x, router, router_bias=None):
    """The family's routing: DeepSeek's grouped top-k (`deepseek.route_grouped`, the bias its
    e_score_correction_bias) or `route` (the bias GPT-OSS's router bias)."""
    if config.topk_method:
        from .deepseek import route_grouped
        return route_grouped(x, router, config, router_bias)
    return route(x, router, config.num_experts_per_tok, config.norm_topk_prob, router_bias)


def grouped_expert_mlp(x_sorted, group_sizes, w_gate, w_up, w_down, glu=None, biases=None):
    """SwiGLU (or `glu`, with per-expert `biases`) over tokens already sorted by expert: one
    grouped matmul per projection. Quantized experts pass as (values, scales [E, G, F]) pairs,
    packed integer ones (W4A16, W8A16) as `kernels.grouped_int.IntExperts`: the kernels
    dequantize them."""
    if any(quant.is_packed(w) for w in (w_gate, w_up, w_down)):
        w_gate, w_up, w_down = (quant.grouped_operand(w) for w in (w_gate, w_up, w_down))
    elif quant.is_quantized(w_gate):
        if glu is not None or biases is not None:
            raise ValueError("quantized experts take only SwiGLU without biases (not GPT-OSS's)")
        w_gate, w_up, w_down = (quant.grouped_operand(w) for w in (w_gate, w_up, w_down))
    return kernels.grouped_mlp(x_sorted, group_sizes, w_gate, w_up, w_down, glu=glu,
                               biases=biases)


def clamped_swiglu(limit: float, alpha: float):
    """GPT-OSS's expert activation: gate clamped above, up clamped both ways, up shifted by 1."""
    def glu(gate, up):
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(gate * alpha) * (up + 1)
    return glu


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
        router_bias, biases, glu = None, None, None
        if c.expert_bias:
            zeros = nn.initializers.zeros
            router_bias = param(self, "router_bias", (e,), (None,), self.dtype, zeros)
            biases = (param(self, "b_gate", (e, f), ("experts", "mlp"), self.dtype, zeros),
                      param(self, "b_up", (e, f), ("experts", "mlp"), self.dtype, zeros),
                      param(self, "b_down", (e, d), ("experts", "embed"), self.dtype, zeros))
        if c.topk_method == "noaux_tc":  # DeepSeek-V3's e_score_correction_bias (float32)
            router_bias = param(self, "score_bias", (e,), (None,), jnp.float32,
                                nn.initializers.zeros)
        if c.swiglu_limit is not None:
            glu = clamped_swiglu(c.swiglu_limit, c.swiglu_alpha)
        # DeepSeek's shared experts: one dense MLP every token takes beside the routed ones.
        shared = MLP(c, self.dtype, c.moe_intermediate_size * c.n_shared_experts,
                     name="shared")(x) if c.n_shared_experts else 0
        shape = x.shape
        x = x.reshape(-1, d)
        if (hooks := _HOOKS.get()) is not None:
            extras = {} if router_bias is None else dict(router_bias=router_bias)
            extras |= {} if biases is None else dict(biases=biases)
            return hooks.moe(x, router, w_gate, w_up, w_down, glu=glu, **extras).reshape(
                shape) + shared
        weights, experts = route_tokens(c, x, router, router_bias)
        expert_fn = lambda xs, sizes: grouped_expert_mlp(xs, sizes, w_gate, w_up, w_down, glu,
                                                         biases)
        return moe_dispatch_combine(x, weights, experts, e, expert_fn).reshape(shape) + shared
