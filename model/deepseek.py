"""DeepSeek-V2/V3: the experts' group-limited routing and the checkpoint's tensor names.

The attention is `mla.py`; the decoder, norms and expert MLPs are the shared ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig


def route_grouped(x, router, config: ModelConfig, score_bias=None):
    """DeepSeek's routing: scores are the softmax or the sigmoid of the router logits (f32).
    With n_group > 1 the experts come only from the topk_group best groups, a group ranked by
    its best score (group_limited_greedy) or the sum of its best two (noaux_tc, on scores plus
    `score_bias`, the e_score_correction_bias). The bias only picks experts: the weights are
    the scores, renormalized if norm_topk_prob, times routed_scaling_factor.
    Returns (weights [N, k], experts [N, k])."""
    c = config
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if c.scoring_func == "sigmoid" else jax.nn.softmax(logits, -1)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if c.n_group > 1 and c.topk_method != "greedy":
        groups = choice.reshape(*choice.shape[:-1], c.n_group, -1)
        if c.topk_method == "noaux_tc":
            rank = jax.lax.top_k(groups, 2)[0].sum(-1)
        else:
            rank = groups.max(-1)
        _, best = jax.lax.top_k(rank, c.topk_group)
        keep = jnp.any(best[..., None] == jnp.arange(c.n_group), axis=-2)  # [N, n_group]
        # transformers masks with 0 after a softmax (group_limited_greedy), -inf for noaux_tc.
        fill = -jnp.inf if c.topk_method == "noaux_tc" else 0.0
        choice = jnp.where(keep[..., None], groups, fill).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return (weights * c.routed_scaling_factor).astype(x.dtype), experts


def _rope_order(n: int) -> np.ndarray:
    """DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; the decoder rotates the two
    halves. Reordering the RoPE rows of the q and kv projections as evens then odds makes one
    the other (q and k move alike, so their dot products are unchanged)."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def layer_sources(c: ModelConfig, i: int) -> dict[tuple, tuple]:
    """One layer's param path -> (HF tensor names, function building the param from them)."""
    p, L = f"model.layers.{i}.", f"layers_{i}"
    a = p + "self_attn."
    h, nope, rope, lat = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    order = _rope_order(rope) if c.rope_interleave else np.arange(rope)
    q_rows = np.concatenate([np.arange(nope), nope + order])

    def q_weight(w):  # [H * (nope + rope), in] -> [in, H, nope + rope]
        return np.moveaxis(w.reshape(h, nope + rope, -1)[:, q_rows], -1, 0)

    def kv_b(w, part):  # [H * (nope + v), lat] -> w_uk [lat, H, nope] or w_uv [lat, H, v]
        w = w.reshape(h, nope + c.v_head_dim, lat)
        return np.transpose(w[:, :nope] if part == 0 else w[:, nope:], (2, 0, 1))

    out = {(L, "attn_norm", "scale"): ([p + "input_layernorm.weight"], None),
           (L, "mlp_norm", "scale"): ([p + "post_attention_layernorm.weight"], None),
           (L, "attn", "wkv_a"): ([a + "kv_a_proj_with_mqa.weight"],
                                  lambda w: w[np.concatenate([np.arange(lat), lat + order])].T),
           (L, "attn", "kv_norm", "scale"): ([a + "kv_a_layernorm.weight"], None),
           (L, "attn", "w_uk"): ([a + "kv_b_proj.weight"], lambda w: kv_b(w, 0)),
           (L, "attn", "w_uv"): ([a + "kv_b_proj.weight"], lambda w: kv_b(w, 1)),
           (L, "attn", "wo"): ([a + "o_proj.weight"],
                               lambda w: w.T.reshape(h, c.v_head_dim, c.hidden_size))}
    if c.q_lora_rank:
        out[(L, "attn", "wq_a")] = ([a + "q_a_proj.weight"], lambda w: w.T)
        out[(L, "attn", "q_norm", "scale")] = ([a + "q_a_layernorm.weight"], None)
        out[(L, "attn", "wq_b")] = ([a + "q_b_proj.weight"], q_weight)
    else:
        out[(L, "attn", "wq")] = ([a + "q_proj.weight"], q_weight)
    names = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    if not c.layer_is_moe(i):
        for ours, theirs in names.items():
            out[(L, "mlp", ours)] = ([f"{p}mlp.{theirs}.weight"], lambda w: w.T)
        return out
    out[(L, "moe", "router")] = ([p + "mlp.gate.weight"], lambda w: w.T)
    if c.topk_method == "noaux_tc":
        out[(L, "moe", "score_bias")] = ([p + "mlp.gate.e_score_correction_bias"], None)
    stack = lambda *ws: np.stack([w.T for w in ws])
    for ours, theirs in names.items():
        out[(L, "moe", ours)] = (
            [f"{p}mlp.experts.{e}.{theirs}.weight" for e in range(c.num_experts)], stack)
        if c.n_shared_experts:
            out[(L, "moe", "shared", ours)] = (
                [f"{p}mlp.shared_experts.{theirs}.weight"], lambda w: w.T)
    return out


def is_extra_layer(name: str, config: ModelConfig) -> bool:
    """DeepSeek-V3 checkpoints append their multi-token-prediction layers after the decoder's
    (model.layers.{num_layers}...): next-token decoding does not use them."""
    parts = name.split(".")
    return (config.model_type == "deepseek_v3" and name.startswith("model.layers.")
            and parts[2].isdigit() and int(parts[2]) >= config.num_layers)
