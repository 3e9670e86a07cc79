"""Model configuration: one frozen, hashable dataclass read from a Hugging Face `config.json`.

Hashable so it can be a static argument of `jax.jit`. Anything the model does not implement is
rejected here with the offending field named, so an unsupported checkpoint never runs wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2",
            "gemma3_text", "gpt_oss", "deepseek_v2", "deepseek_v3")
# Families whose every layer takes `sliding_window` when it is set (no per-layer choice).
WINDOW_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe", "phi3")
MOE = ("mixtral", "qwen3_moe", "gpt_oss")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention (model/mla.py)
GEMMA = ("gemma2", "gemma3_text")
# transformers' defaults where config.json leaves max_position_embeddings out.
MAX_POSITIONS = {"mistral": 131072, "mixtral": 131072, "qwen2": 32768, "qwen3": 32768,
                 "qwen3_moe": 32768, "gemma2": 8192, "gemma3_text": 131072,
                 "gpt_oss": 131072, "deepseek_v2": 2048, "deepseek_v3": 4096}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


WEIGHT_FORMATS = ("fp8", "compressed-tensors", "awq", "gptq")


class ConfigError(ValueError):
    """A checkpoint's config asks for something pallasite does not support."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # "default", "linear", "llama3", "yarn" or "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN: the band between beta_fast and beta_slow rotations blends interpolation and
    # extrapolation; cos/sin (so q and k both) are multiplied by attention_factor.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # LongRoPE: per-frequency divisors, the long set once a sequence passes original_max_position.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    rotary_dim: int = 0  # leading head dims RoPE rotates (0: all)
    # Per layer "full_attention" or "sliding_attention" (empty: all full); sliding layers attend
    # to the last `sliding_window` positions, the query's own included.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # RoPE of sliding layers where it differs (Gemma 3's local base); None: as full layers.
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    # Gemma: RMSNorm scales by (1 + weight), the embedding by sqrt(hidden), norms before and
    # after both attention and MLP, scores scaled by query_pre_attn_scalar**-0.5, tanh caps.
    norm_plus_one: bool = False
    scale_embed: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts (num_experts == 0 means a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # GPT-OSS: a learned sink logit per head, a bias on the output projection, the router and
    # each expert; softmax over the top-k logits; clamped SwiGLU (gate * sigmoid(alpha * gate) *
    # (up + 1), gate <= limit, |up| <= limit); experts shipped as MXFP4 ("mxfp4") or plain.
    sinks: bool = False
    o_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    expert_weights: str = ""
    # DeepSeek's multi-head latent attention (kv_lora_rank > 0): queries through an optional
    # low-rank q_lora_rank, keys and values from one shared latent of kv_lora_rank dims plus a
    # RoPE key of qk_rope_head_dim shared by all heads; head_dim is qk_nope + qk_rope.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_mscale: float = 1.0  # YaRN's mscale_all_dim: scores scale by its square
    rope_interleave: bool = False  # RoPE on interleaved pairs (the loader reorders the rows)
    # DeepSeek's MoE: shared experts beside the routed ones; dense MLPs in the first layers (and
    # off the moe_layer_freq stride); experts chosen within the best topk_group of n_group groups
    # ("greedy", "group_limited_greedy" by each group's best, "noaux_tc" by each group's best two
    # with e_score_correction_bias added for the choice only); weights scaled by routed_scaling.
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = ""
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def layer_is_moe(self, layer: int) -> bool:
        """Whether `layer` routes to experts (DeepSeek keeps its first layers dense)."""
        return self.is_moe and layer >= self.first_k_dense_replace and (
            layer % self.moe_layer_freq == 0)

    @property
    def kv_arrays(self) -> tuple[int, ...]:
        """The last dim of each of a layer's page arrays: K and V (`page_head_dim` each), or
        MLA's latent (kv_lora_rank) and RoPE key (qk_rope_head_dim), with num_kv_heads = 1."""
        if self.is_mla:
            return (self.kv_lora_rank, self.qk_rope_head_dim)
        return (self.page_head_dim, self.page_head_dim)

    @property
    def page_head_dim(self) -> int:
        """The K/V pages' last dim: head_dim, or past a head dim that is not a power of two
        (Phi-3-mini's 96) the next power of two, the one the attention kernels tile; queries
        and keys take zeros there, so the scores keep their values (`attention.attend`)."""
        return 1 << (self.head_dim - 1).bit_length()

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope(self, layer: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of `layer`'s rotary embedding."""
        if self.is_sliding(layer) and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling or RopeScaling()
        return self.rope_theta, self.rope_scaling

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * self.softmax_mscale ** 2

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type {self.model_type!r} is not supported; supported: {FAMILIES}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ConfigError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..{self.num_experts}")
        if self.hidden_act not in ACTIVATIONS.values():
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.is_mla and self.num_kv_heads != 1:
            raise ConfigError("multi-head latent attention keeps one latent: num_kv_heads must "
                              f"be 1, got {self.num_kv_heads}")
        if self.is_moe and (self.num_experts % self.n_group or not
                            0 < self.topk_group <= self.n_group):
            raise ConfigError(f"n_group ({self.n_group}) must divide n_routed_experts "
                              f"({self.num_experts}) and topk_group ({self.topk_group}) be in "
                              f"1..n_group")
        if self.topk_method not in ("", "greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"topk_method {self.topk_method!r} is not supported (supported: "
                              "greedy, group_limited_greedy, noaux_tc)")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (supported: "
                              "softmax, sigmoid)")
        if not (self.rotary_dim == 0 or 0 < self.rotary_dim <= self.head_dim
                and self.rotary_dim % 2 == 0):
            raise ConfigError(f"rotary_dim {self.rotary_dim} must be even and <= head_dim "
                              f"({self.head_dim})")


def _get(raw: dict, *names, default=None):
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return default


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _scaling(params: dict, raw: dict, rotary_dim: int) -> RopeScaling:
    """One rope-parameters dict -> RopeScaling, with transformers' defaults and derived values."""
    kind = params.get("rope_type", params.get("type", "default"))
    if raw["model_type"] == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi-3 names its LongRoPE "su" or "yarn"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    max_pos = raw.get("max_position_embeddings", MAX_POSITIONS.get(raw["model_type"], 4096))
    # The pretraining length: a top-level field wins (Phi-3 always has one, 4096 by default).
    orig = raw.get("original_max_position_embeddings",
                   4096 if raw["model_type"] == "phi3" else None)
    orig = int(orig or params.get("original_max_position_embeddings") or max_pos)
    if kind == "llama3":
        return RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                           float(params["high_freq_factor"]), orig)
    factor = params.get("factor")
    factor = float(max_pos / orig if factor is None else factor)
    attention = params.get("attention_factor")
    if kind == "yarn":
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if attention is None:
            attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all)
                         if mscale and mscale_all else _mscale(factor))
        return RopeScaling("yarn", factor, original_max_position=orig,
                           beta_fast=float(params.get("beta_fast") or 32),
                           beta_slow=float(params.get("beta_slow") or 1),
                           truncate=bool(params.get("truncate", True)),
                           attention_factor=float(attention))
    if kind == "longrope":
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
        if not len(short) == len(long) == rotary_dim // 2:
            raise ConfigError(f"rope short_factor/long_factor must have {rotary_dim // 2} entries, "
                              f"got {len(short)}/{len(long)}")
        return RopeScaling("longrope", factor, original_max_position=orig,
                           attention_factor=float(attention), short_factor=short, long_factor=long)
    raise ConfigError(f"rope_scaling type {kind!r} is not supported "
                      "(supported: default, linear, llama3, yarn, longrope)")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope(raw: dict, rotary_dim: int):
    """-> (theta, scaling, local theta or None, local scaling or None)."""
    # transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x folds both into `rope_parameters`,
    # nested by layer type where those differ (Gemma 3).
    given = raw.get("rope_parameters") or {}
    nested = any(t in given for t in LAYER_TYPES)
    if raw["model_type"] == "gemma3_text":
        full = dict(given.get("full_attention") or {}) if nested else {
            **(raw.get("rope_scaling") or {}), **given}
        local = dict(given.get("sliding_attention") or {}) if nested else {}
        theta = float(full.get("rope_theta") or raw.get("rope_theta") or 1e6)
        local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 1e4)
        return (theta, _scaling(full, raw, rotary_dim), local_theta,
                _scaling(local, raw, rotary_dim))
    if nested:
        raise ConfigError(f"rope_parameters per layer type is not supported for "
                          f"{raw['model_type']}")
    params = {**(raw.get("rope_scaling") or {}), **given}
    if raw["model_type"] == "gpt_oss" and not params:  # transformers' GptOssConfig default
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": False, "original_max_position_embeddings": 4096}
    default_theta = 150000.0 if raw["model_type"] == "gpt_oss" else 10000.0
    theta = float(_get(params, "rope_theta", default=_get(raw, "rope_theta", default=default_theta)))
    return theta, _scaling(params, raw, rotary_dim), None, None


def _activation(raw: dict, model_type: str) -> str:
    # Gemma's MLP reads `hidden_activation`; the others read `hidden_act`.
    act = (raw.get("hidden_activation") or "gelu_pytorch_tanh") if model_type in GEMMA else (
        raw.get("hidden_act") or "silu")
    if act not in ACTIVATIONS or (model_type in MOE and act != "silu"):
        raise ConfigError(f"hidden_act {act!r} is not supported for {model_type} "
                          f"(supported: {sorted(ACTIVATIONS)}; experts: silu)")
    return ACTIVATIONS[act]


def _layer_types(raw: dict, model_type: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(per-layer attention types, sliding window), read as transformers reads each family."""
    full = ("full_attention",) * num_layers
    defaults = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "qwen3_moe": 4096, "gemma2": 4096,
                "gemma3_text": 4096, "gpt_oss": 128}
    window = raw.get("sliding_window", defaults.get(model_type))
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if model_type == "llama" or window is None:
        types = full
    elif model_type in WINDOW_EVERY_LAYER:
        types = ("sliding_attention",) * num_layers
    elif raw.get("layer_types"):
        types = tuple(raw["layer_types"][:num_layers])
    elif model_type in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", 28)
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(num_layers))
    else:  # Gemma, GPT-OSS: sliding except every `pattern`-th layer (every other but Gemma 3)
        pattern = raw.get("sliding_window_pattern", 6) if model_type == "gemma3_text" else 2
        types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                      for i in range(num_layers))
    unknown = set(types) - set(LAYER_TYPES)
    if unknown:
        raise ConfigError(f"layer_types {sorted(unknown)} is not supported "
                          f"(supported: {LAYER_TYPES})")
    return types, window


def _check_unsupported(raw: dict, model_type: str):
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not supported (causal only)")
    if model_type == "qwen3_moe":
        sparse_step = raw.get("decoder_sparse_step", 1)
        dense_layers = raw.get("mlp_only_layers") or []
        if sparse_step != 1 or dense_layers:
            raise ConfigError(
                "qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                "is not supported")
    quant = raw.get("quantization_config")
    method = (quant or {}).get("quant_method")
    # Weight formats the loader reads (model/fp8_checkpoint.py, model/int_formats.py check
    # their options), and gpt_oss's mxfp4 experts, dequantized on load.
    if quant and method not in WEIGHT_FORMATS and not (model_type == "gpt_oss"
                                                        and method == "mxfp4"):
        raise ConfigError(f"quantization_config {method!r} is not supported (supported: "
                          f"{', '.join(WEIGHT_FORMATS)}, and mxfp4 for gpt_oss)")
    partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                     raw.get("partial_rotary_factor", 1.0))
    if model_type != "phi3" and partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={partial} is only supported for phi3")


def config_from_dict(raw: dict, name: str = "") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {FAMILIES}")
    num_layers = int(raw["num_hidden_layers"])
    _check_unsupported(raw, model_type)
    if model_type in DEEPSEEK:  # one latent for all heads: its kv heads are set by _deepseek
        raw = {**raw, "num_key_value_heads": raw["num_attention_heads"]}
    gemma = model_type in GEMMA
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(_get(raw, "head_dim", default=256 if gemma else hidden // heads))
    partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                     raw.get("partial_rotary_factor")) or 1.0
    rotary_dim = int(head_dim * partial)
    theta, scaling, local_theta, local_scaling = _rope(raw, rotary_dim)
    layer_types, window = _layer_types(raw, model_type, num_layers)
    max_pos = int(raw.get("max_position_embeddings", MAX_POSITIONS.get(model_type, 4096)))
    if window is not None and window >= max_pos:  # binds at no position the model takes
        window = None
    eos = raw.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    moe = model_type in MOE
    oss = model_type == "gpt_oss"
    cap = lambda key, gemma2_default: raw.get(key, gemma2_default if model_type == "gemma2" else None)
    config = ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)),
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5 if oss else 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", oss)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        hidden_act=_activation(raw, model_type),
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        layer_types=() if set(layer_types) == {"full_attention"} else layer_types,
        sliding_window=window,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        norm_plus_one=gemma,
        scale_embed=gemma,
        sandwich_norms=gemma,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if gemma else None,
        attn_logit_softcap=cap("attn_logit_softcapping", 50.0) if gemma else None,
        final_logit_softcap=cap("final_logit_softcapping", 30.0) if gemma else None,
        num_experts=int(_get(raw, "num_local_experts", "num_experts", default=0)) if moe else 0,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if moe else 0,
        moe_intermediate_size=int(
            raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0) if moe else 0,
        # Mixtral always renormalizes its top-k weights; Qwen3-MoE only when norm_topk_prob.
        # GPT-OSS takes the softmax over the top-k logits: normalized by construction.
        norm_topk_prob=True if model_type in ("mixtral", "gpt_oss") else bool(
            raw.get("norm_topk_prob", True)),
        sinks=oss,
        o_bias=oss and bool(raw.get("attention_bias", True)),
        expert_bias=oss,
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)) if oss else None,
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)) if oss else 1.0,
        expert_weights="mxfp4" if raw.get("quantization_config") else "",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
        name=name,
    )
    return config.replace(**_deepseek(raw, config)) if model_type in DEEPSEEK else config


def _deepseek(raw: dict, config: ModelConfig) -> dict:
    """The fields DeepSeek-V2/V3 set, read with transformers' defaults. V3 always scores with a
    sigmoid and picks by noaux_tc (transformers' DeepseekV3TopkRouter reads neither field); V2
    scores with a softmax and takes `topk_method` (greedy or group_limited_greedy)."""
    v3 = raw["model_type"] == "deepseek_v3"
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            raise ConfigError(f"{field}=true is not supported for {raw['model_type']}")
    nope, rope = int(raw.get("qk_nope_head_dim", 128)), int(raw.get("qk_rope_head_dim", 64))
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    mscale = 1.0
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get(
            "mscale_all_dim"):
        mscale = _mscale(float(params["factor"]), float(params["mscale_all_dim"]))
    experts = int(raw.get("n_routed_experts") or 0)
    topk = raw.get("topk_method") or "greedy"
    return dict(
        num_kv_heads=1, head_dim=nope + rope, rotary_dim=0, qkv_bias=False,
        q_lora_rank=int(raw.get("q_lora_rank") or 0),
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=int(raw.get("v_head_dim") or 128),
        softmax_mscale=mscale, rope_interleave=not v3 or bool(raw.get("rope_interleave", True)),
        num_experts=experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0)
        if experts else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 1407)) if experts else 0,
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
        n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
        topk_method="noaux_tc" if v3 else topk, scoring_func="sigmoid" if v3 else "softmax",
        # As DeepSeek's own code and vLLM read it (transformers' V2 router ignores the field;
        # DeepSeek-V2's published configs set it false).
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {file}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    missing = [k for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads") if k not in raw]
    if missing:
        raise ConfigError(f"{file} lacks required field(s) {missing}")
    return config_from_dict(raw, name=path.name if path.is_dir() else path.parent.name)


def to_hf_dict(config: ModelConfig) -> dict:
    """The Hugging Face `config.json` for a config (used by export and the default model)."""
    if (config.model_type not in FAMILIES[:6] or config.layer_types or config.rotary_dim
            or config.hidden_act != "silu" or config.rope_scaling.kind == "longrope"):
        raise ConfigError(f"writing a config.json for this {config.model_type} config is not "
                          "supported (sliding windows, partial RoPE, LongRoPE, GeGLU, Phi-3, Gemma)")
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[config.model_type]
    rs = config.rope_scaling
    scaling = None
    if rs.kind == "linear":
        scaling = {"rope_type": "linear", "factor": rs.factor}
    elif rs.kind == "llama3":
        scaling = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                   "high_freq_factor": rs.high_freq_factor,
                   "original_max_position_embeddings": rs.original_max_position}
    elif rs.kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": rs.factor, "beta_fast": rs.beta_fast,
                   "beta_slow": rs.beta_slow, "truncate": rs.truncate,
                   "attention_factor": rs.attention_factor,
                   "original_max_position_embeddings": rs.original_max_position}
    out = {
        "architectures": [arch], "model_type": config.model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": scaling, "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": config.qkv_bias and config.model_type != "qwen2",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else
        (config.eos_token_ids[0] if config.eos_token_ids else None),
    }
    if config.is_moe:
        key = "num_local_experts" if config.model_type == "mixtral" else "num_experts"
        out.update({key: config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
                    "moe_intermediate_size": config.moe_intermediate_size,
                    "norm_topk_prob": config.norm_topk_prob})
    return out
