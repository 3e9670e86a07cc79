"""The mesh and parameter shardings training uses: the same as inference's, from `sharding/`.

Until `sharding/` provides them, a (data, tensor, expert) mesh with replicated params stands in.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "tensor", "expert")


def make_mesh(data: int = 1, tensor: int = 1, expert: int = 1) -> Mesh:
    need, have = data * tensor * expert, len(jax.devices())
    if need > have:
        raise ValueError(f"a mesh of data={data} x tensor={tensor} x expert={expert} needs "
                         f"{need} devices; {have} available")
    try:
        from ..sharding.mesh import make_mesh as sharding_make_mesh
        from ..sharding.plan import MeshPlan
    except ImportError:
        return Mesh(np.array(jax.devices()[:need]).reshape(data, tensor, expert), AXES)
    return sharding_make_mesh(MeshPlan(data, tensor, expert))


def param_shardings(config, mesh):
    try:
        from ..sharding.mesh import param_shardings as sharding_param_shardings
    except ImportError:
        from ..model import param_shapes
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), param_shapes(config))
    return sharding_param_shardings(config, mesh)
