"""A mesh plan, (data, tensor, expert) device counts, and the checks that reject a plan before
anything is compiled: sizes that do not divide the model or the devices (whether the weights fit
is `rules.check_fits`: it needs the partition rules, which build on the plan).

Pure Python over the model config: no devices are touched, so the plan explorer and the CLI can
call it freely.
"""

from __future__ import annotations

import dataclasses
import re

from ..model.config import ModelConfig

AXIS_ALIASES = {"dp": "data", "data": "data", "tp": "tensor", "tensor": "tensor",
                "ep": "expert", "expert": "expert"}


class PlanError(ValueError):
    """A mesh plan that cannot run this model on these devices; the message says what would."""


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    data: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self):
        for axis in ("data", "tensor", "expert"):
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise PlanError(f"mesh axis {axis} must be a positive count, got "
                                f"{getattr(self, axis)!r}")

    @property
    def size(self) -> int:
        return self.data * self.tensor * self.expert

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.tensor, self.expert)

    def __str__(self):
        return f"dp={self.data},tp={self.tensor},ep={self.expert}"

    @classmethod
    def parse(cls, text: str) -> "MeshPlan":
        """"dp=2,tp=4" (any of dp/tp/ep or data/tensor/expert, missing ones are 1), or three
        counts "2x4x1" / "2,4,1" in (data, tensor, expert) order."""
        text = text.strip().lower()
        if re.fullmatch(r"\d+([x,]\d+){2}", text):
            return cls(*(int(n) for n in re.split(r"[x,]", text)))
        counts = {}
        for part in filter(None, text.split(",")):
            name, _, value = part.partition("=")
            axis = AXIS_ALIASES.get(name.strip())
            if axis is None or not value.strip().isdigit() or axis in counts:
                raise PlanError(f"cannot read mesh {text!r}: write e.g. 'dp=2,tp=4,ep=1' or "
                                "'2x4x1' (data x tensor x expert)")
            counts[axis] = int(value)
        return cls(**counts)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]


def tensor_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes this model can be split into (up to `limit`)."""
    kv = config.num_kv_heads
    mlp = config.moe_intermediate_size if config.is_moe else config.intermediate_size
    return [t for t in _divisors(config.num_heads, limit)
            if (kv % t == 0 or t % kv == 0) and mlp % t == 0]


def validate_plan(config: ModelConfig, plan: MeshPlan, num_devices: int | None = None):
    """Raise PlanError unless `plan` can run `config` (on `num_devices` devices, if given)."""
    t, e = plan.tensor, plan.expert
    fits = tensor_sizes(config, max(t, 8))
    if config.num_heads % t:
        raise PlanError(f"tensor={t} does not divide num_heads={config.num_heads}; tensor sizes "
                        f"that fit this model: {fits}")
    kv = config.num_kv_heads
    if kv % t and t % kv:
        raise PlanError(f"tensor={t} and num_kv_heads={kv}: one must divide the other (kv heads "
                        f"are split, or copied when fewer than tensor); sizes that fit: {fits}")
    mlp_name = "moe_intermediate_size" if config.is_moe else "intermediate_size"
    if getattr(config, mlp_name) % t:
        raise PlanError(f"tensor={t} does not divide {mlp_name}={getattr(config, mlp_name)}; "
                        f"tensor sizes that fit this model: {fits}")
    if e > 1 and not config.is_moe:
        raise PlanError(f"expert={e} needs a mixture-of-experts model; {config.model_type} is "
                        "dense: use expert=1")
    if config.is_moe and config.num_experts % e:
        raise PlanError(f"expert={e} does not divide num_experts={config.num_experts}; expert "
                        f"sizes that fit: {_divisors(config.num_experts, config.num_experts)}")
    if num_devices is not None and num_devices % plan.size:
        raise PlanError(f"mesh {plan} needs {plan.size} devices, which does not divide the "
                        f"{num_devices} available; plan sizes that fit: "
                        f"{_divisors(num_devices, num_devices)}")
