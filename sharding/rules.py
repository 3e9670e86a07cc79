"""Partition rules: which mesh axis each logical axis of a parameter, activation or KV page is split
over. Megatron-style tensor parallelism: attention heads, MLP hidden units and the vocabulary are
split over "tensor" (column-parallel QKV and gate/up, row-parallel output and down, vocab-parallel
embedding and LM head); experts over "expert"; the model dimension is never split.

An axis whose size does not divide its mesh axis is replicated instead. `validate_plan` rejects
that for heads, MLP units and experts, so it only happens to kv heads (fewer kv heads than
tensor shards: each kv head is copied to the shards whose query heads read it) and to odd
vocabularies and batches.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from ..model import ModelConfig, param_logical_axes, param_shapes, quant
from .plan import MeshPlan, PlanError, _divisors, tensor_sizes

AXES = ("data", "tensor", "expert")

RULES = {
    "batch": "data",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "experts": "expert",
    "embed": None,
    "head_dim": None,
    "length": None,
    "tokens": None,
    "layers": None,
}


def axis_size(plan: MeshPlan, mesh_axis) -> int:
    names = mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)
    return math.prod(getattr(plan, n) for n in names if n is not None)


def logical_to_spec(logical_axes, shape, plan: MeshPlan) -> P:
    """Logical axis names (None = unnamed) of an array of `shape` -> a PartitionSpec."""
    out = []
    for name, dim in zip(logical_axes, shape):
        axis = RULES[name] if name is not None else None
        out.append(axis if axis is not None and dim % axis_size(plan, axis) == 0 else None)
    return P(*out)


@functools.lru_cache(maxsize=16)
def _param_layout(config: ModelConfig):
    """(treedef, shapes, logical names, key paths) of the params, traced once per config."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config))
    logical = jax.tree.leaves(param_logical_axes(config), is_leaf=lambda x: isinstance(x, P))
    return treedef, [s.shape for _, s in leaves], logical, [path for path, _ in leaves]


def param_partition_specs(config: ModelConfig, plan: MeshPlan):
    """A pytree like the params of PartitionSpecs over the mesh axes."""
    treedef, shapes, logical, _ = _param_layout(config)
    return jax.tree.unflatten(treedef, [logical_to_spec(names, shape, plan)
                                        for names, shape in zip(logical, shapes)])


def shard_shape(global_shape, spec: P, plan: MeshPlan) -> tuple:
    """The shape of one device's shard of an array of `global_shape` laid out by `spec`."""
    spec = tuple(spec) + (None,) * (len(global_shape) - len(spec))
    return tuple(-(-dim // axis_size(plan, axis)) for dim, axis in zip(global_shape, spec))


def kv_heads_split(config: ModelConfig, plan: MeshPlan) -> bool:
    """True when kv heads are divided among tensor shards, False when each shard holds a copy of
    the one kv head its query heads read (fewer kv heads than tensor shards)."""
    return config.num_kv_heads % plan.tensor == 0


def kv_cache_heads(config: ModelConfig, plan: MeshPlan) -> int:
    """The head axis of the KV pages on this mesh: the kv heads, or one copy per tensor shard."""
    return config.num_kv_heads if kv_heads_split(config, plan) else plan.tensor


def kv_cache_shape(config: ModelConfig, plan: MeshPlan, num_pages: int, page_size: int):
    return (kv_cache_heads(config, plan), num_pages, page_size, config.page_head_dim)


def kv_cache_partition_spec(config: ModelConfig, plan: MeshPlan) -> P:
    """KV pages [heads, pages, page_size, head_dim] are split over tensor by head (always
    divisible: see `kv_cache_heads`) and copied over data and expert."""
    return P("tensor", None, None, None)


def param_bytes_per_device(config: ModelConfig, plan: MeshPlan, dtype,
                           quantization: str | None = None) -> int:
    """Bytes of parameters each device holds under `plan` (exact, from the partition rules).
    With `quantization="fp8"` the linear weights count one byte an element (their float32
    per-channel scales are under 0.1% more and not counted)."""
    import numpy as np

    _, shapes, logical, paths = _param_layout(config)
    total = 0
    for path, shape, names in zip(paths, shapes, logical):
        size = math.prod(shard_shape(shape, logical_to_spec(names, shape, plan), plan))
        keys = tuple(getattr(k, "key", k) for k in path)
        one = 1 if quantization and quant.linear_axes(keys) else np.dtype(dtype).itemsize
        total += one * size
    return total


def check_fits(config: ModelConfig, plan: MeshPlan, device_memory_bytes: int, dtype,
               weight_fraction: float = 0.9, quantization: str | None = None) -> int:
    """Raise PlanError if one device's share of the weights exceeds `weight_fraction` of its
    memory (the rest is for the KV cache and activations). Returns the bytes per device."""
    need = param_bytes_per_device(config, plan, dtype, quantization)
    budget = weight_fraction * device_memory_bytes
    if need <= budget:
        return need
    experts = _divisors(config.num_experts, config.num_experts) if config.is_moe else [1]
    candidates = sorted((MeshPlan(1, t, e) for t in tensor_sizes(config) for e in experts),
                        key=lambda p: (p.size, p.expert))
    fits = [f"tp={p.tensor}" + (f",ep={p.expert}" if config.is_moe else "") for p in candidates
            if param_bytes_per_device(config, p, dtype, quantization) <= budget][:3]
    hint = (f"smallest plans that fit: {'; '.join(fits)}" if fits else
            "no tensor/expert split of this model fits")
    raise PlanError(f"mesh {plan}: weights need {need / 2**30:.2f} GiB per device, over "
                    f"{weight_fraction:.0%} of its {device_memory_bytes / 2**30:.2f} GiB; {hint}")
