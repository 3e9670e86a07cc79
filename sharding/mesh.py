"""The device mesh, one process or many, and placing params and KV pages on it.

A one-device run is the 1x1x1 mesh: the same code path, nothing special-cased. With several
processes (`initialize_distributed` first), `jax.devices()` lists every process's devices and the
mesh spans them all; each process then holds only its own devices' shards.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..model import ModelConfig, quant
from .plan import MeshPlan, PlanError, validate_plan
from .rules import AXES, kv_cache_partition_spec, kv_cache_shape, param_partition_specs


def make_mesh(plan: MeshPlan, devices=None) -> Mesh:
    """A ("data", "tensor", "expert") mesh over the first `plan.size` devices. Devices are laid
    out topology-aware where JAX knows the topology; otherwise in process order, so the inner
    (tensor, expert) axes stay within one host and only "data" crosses hosts."""
    devices = list(jax.devices() if devices is None else devices)
    if plan.size > len(devices):
        raise PlanError(f"mesh {plan} needs {plan.size} devices; {len(devices)} available")
    devices = devices[:plan.size]
    try:
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(plan.shape, devices)
    except Exception:  # unknown topology (e.g. fake CPU devices): keep the given order
        grid = np.array(devices).reshape(plan.shape)
    # Auto axes: GSPMD propagates shardings; shard_map regions say theirs explicitly.
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is None:
        return Mesh(grid, AXES)
    return Mesh(grid, AXES, axis_types=(auto.Auto,) * len(AXES))


def plan_of(mesh: Mesh) -> MeshPlan:
    return MeshPlan(*(int(mesh.shape[a]) for a in AXES))


def initialize_distributed(coordinator: str, num_processes: int, process_id: int):
    """Join a multi-process run (one process per host, or per GPU group). Call before anything
    touches a device. CPU runs exchange data through gloo."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # a JAX without the option: its default CPU collectives are used
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def add_mesh_arguments(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("device mesh")
    g.add_argument("--mesh", default="dp=1,tp=1,ep=1",
                   help="data, tensor and expert parallel sizes, e.g. 'tp=4' or 'dp=2,tp=4'")
    g.add_argument("--coordinator", default=None,
                   help="host:port of process 0, for a run over several processes")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=0)
    return parser


def mesh_from_args(args, config: ModelConfig | None = None) -> Mesh:
    """The mesh the CLI flags ask for; joins the multi-process run first if one is named. With
    `config`, the plan is checked against the model before any device work."""
    if args.coordinator:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    plan = MeshPlan.parse(args.mesh)
    if config is not None:
        validate_plan(config, plan, len(jax.devices()))
    return make_mesh(plan)


def param_shardings(config: ModelConfig, mesh: Mesh):
    """A pytree like the params of NamedShardings (pass to `load_hf(..., shardings=)`)."""
    specs = param_partition_specs(config, plan_of(mesh))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params, config: ModelConfig, mesh: Mesh):
    """Place params (host or device arrays) on their shardings; each device gets its slice."""
    validate_plan(config, plan_of(mesh))
    return jax.device_put(params, quant.shardings_for(params, param_shardings(config, mesh)))


def kv_cache_sharding(config: ModelConfig, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, kv_cache_partition_spec(config, plan_of(mesh)))


def init_kv_cache(config: ModelConfig, mesh: Mesh, num_pages: int, page_size: int,
                  dtype=jnp.bfloat16):
    """Zeroed KV pages for every layer, created in place on their shards (no full copy on any
    device): a list per layer of (k_pages, v_pages) [kv heads on the mesh, pages, page, dim],
    and the scales of float8 pages (`model.transformer.kv_layer_cache`)."""
    shape = kv_cache_shape(config, plan_of(mesh), num_pages, page_size)
    sharding = kv_cache_sharding(config, mesh)
    from ..model.transformer import kv_layer_cache
    full = lambda shape, value, dtype: jax.jit(lambda: jnp.full(shape, value, dtype),
                                               out_shardings=sharding)()
    return [kv_layer_cache(full, shape, dtype, config.kv_arrays) for _ in range(config.num_layers)]


def data_slices(mesh: Mesh) -> list[Mesh]:
    """One (1, tensor, expert) mesh per index of the data axis: the devices of one replica."""
    return [Mesh(mesh.devices[i:i + 1], AXES, axis_types=mesh.axis_types)
            for i in range(mesh.shape["data"])]


def to_slice(tree, mesh: Mesh):
    """The part of arrays laid out on a larger mesh, copied over its data axis, that lives on
    `mesh` (one data slice of it): the same device buffers re-labelled, no copy."""
    devices = set(mesh.devices.flat)

    def one(x):
        spec = x.sharding.spec
        if any("data" in (a if isinstance(a, tuple) else (a,)) for a in spec if a):
            raise ValueError(f"an array split over 'data' ({spec}) has no copy per data slice")
        target = NamedSharding(mesh, spec)
        by_device = {s.device: s.data for s in x.addressable_shards if s.device in devices}
        return jax.make_array_from_single_device_arrays(
            x.shape, target, [by_device[d] for d in target.addressable_devices_indices_map(x.shape)])

    return jax.tree.map(one, tree)
