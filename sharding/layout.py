"""One object for a model on a mesh: where its params, KV pages and step inputs live, and a
`jit` that traces with the mesh's device hooks. The serving engine and the tools use it; a
one-device run is the 1x1x1 mesh through the same calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..model import ModelConfig, forward, forward_logits, quant
from .mesh import init_kv_cache, kv_cache_sharding, param_shardings, plan_of
from .parallel import with_mesh
from .plan import PlanError, validate_plan


class Layout:
    def __init__(self, config: ModelConfig, mesh: Mesh, *, serving: bool = False):
        """Checks the plan first (PlanError, before anything compiles). `serving`: the mesh is
        one engine's, so it must not have a data axis (replicas take one slice each)."""
        self.config, self.mesh, self.plan = config, mesh, plan_of(mesh)
        validate_plan(config, self.plan)
        if serving and self.plan.data > 1:
            raise PlanError(f"one engine runs on one data slice, not mesh {self.plan}: serve "
                            "data > 1 through serving.replicas.Replicas")
        self.params = param_shardings(config, mesh)
        self.kv_pages = kv_cache_sharding(config, mesh)
        self.replicated = NamedSharding(mesh, P())

    def place_params(self, params):
        """Params (plain or with quantized weights, `model.quant`) onto their shardings."""
        return jax.device_put(params, quant.shardings_for(params, self.params))

    def init_kv_cache(self, num_pages: int, page_size: int, dtype=jnp.bfloat16):
        """KV pages for every layer on their shards (kv heads over tensor; see rules.py)."""
        return init_kv_cache(self.config, self.mesh, num_pages, page_size, dtype)

    def replicate(self, tree):
        return jax.device_put(tree, self.replicated)

    @staticmethod
    def shardings_of(tree):
        """The shardings of committed arrays, as a pytree (for jit's in/out_shardings)."""
        return jax.tree.map(lambda x: x.sharding, tree)

    def jit(self, fn, **jit_kwargs):
        """`jax.jit(fn)` with the model running on this mesh while `fn` traces."""
        return jax.jit(with_mesh(fn, self.config, self.mesh), **jit_kwargs)

    def forward_logits(self):
        """Jitted `forward_logits(params, token_ids, positions=None, segment_ids=None)`."""
        c = self.config
        return self.jit(lambda p, ids, pos=None, seg=None: forward_logits(p, c, ids, pos, seg))

    def forward(self):
        """Jitted `forward(params, tokens, positions, kv_cache, batch)`, kv_cache donated."""
        c = self.config
        return self.jit(lambda p, tok, pos, kv, batch: forward(p, c, tok, pos, kv, batch),
                        donate_argnums=3)
