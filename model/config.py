"""Model configuration: one frozen, hashable dataclass read from a Hugging Face `config.json`.

Hashable so it can be a static argument of `jax.jit`. Anything the model does not implement is
rejected here with the offending field named, so an unsupported checkpoint never runs wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


class ConfigError(ValueError):
    """A checkpoint's config asks for something pallasite does not support."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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
    # Mixture of experts (num_experts == 0 means a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

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


def _get(raw: dict, *names, default=None):
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return default


def _rope(raw: dict) -> tuple[float, RopeScaling]:
    # transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x folds both into `rope_parameters`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(_get(params, "rope_theta", default=_get(raw, "rope_theta", default=10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", float(params["factor"]), float(params["low_freq_factor"]),
            float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _check_unsupported(raw: dict, model_type: str, num_layers: int):
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", model_type == "mistral")
    if window is not None and uses_window and window < raw.get("max_position_embeddings", math.inf):
        raise ConfigError(
            f"sliding_window={window} is not supported: attention here is always full-context")
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    if model_type == "qwen3_moe":
        sparse_step = raw.get("decoder_sparse_step", 1)
        dense_layers = raw.get("mlp_only_layers") or []
        if sparse_step != 1 or dense_layers:
            raise ConfigError(
                "qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                "is not supported")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types[:num_layers]):
        raise ConfigError(f"layer_types {sorted(set(layer_types))} is not supported: only full_attention")


def config_from_dict(raw: dict, name: str = "") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {FAMILIES}")
    num_layers = int(raw["num_hidden_layers"])
    _check_unsupported(raw, model_type, num_layers)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    theta, scaling = _rope(raw)
    eos = raw.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    moe = model_type in ("mixtral", "qwen3_moe")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)),
        head_dim=int(_get(raw, "head_dim", default=hidden // heads)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        num_experts=int(_get(raw, "num_local_experts", "num_experts", default=0)) if moe else 0,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)) if moe else 0,
        moe_intermediate_size=int(
            raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0) if moe else 0,
        # Mixtral always renormalizes its top-k weights; Qwen3-MoE only when norm_topk_prob.
        norm_topk_prob=True if model_type == "mixtral" else bool(raw.get("norm_topk_prob", True)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
        name=name,
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
