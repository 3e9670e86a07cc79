"""Device meshes and partition rules that place params, the KV cache and batches on devices.

    plan    MeshPlan (data, tensor, expert), validate_plan   -- no devices needed
    rules   logical axis -> mesh axis table, PartitionSpecs, shard shapes, check_fits
    mesh    make_mesh, multi-process start-up, CLI flags, placing params and KV pages
    parallel / experts   the hooks the model calls on a mesh: shard_map attention, expert parallel
    layout  Layout: one model on one mesh (what the engine uses)
"""

from .plan import MeshPlan, PlanError, validate_plan
from .rules import (AXES, RULES, check_fits, kv_cache_partition_spec, param_partition_specs,
                    shard_shape)
from .mesh import (add_mesh_arguments, data_slices, init_kv_cache, initialize_distributed,
                   make_mesh, mesh_from_args, param_shardings, plan_of, shard_params, to_slice)
from .parallel import MeshHooks, with_mesh
from .layout import Layout
