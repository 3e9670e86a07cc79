"""Running the model on a mesh: the device hooks the model calls (attention per shard of heads
through `shard_map`, expert-parallel MoE, activation constraints), and `with_mesh`, which
installs them while a function traces. Everything else in the step is left to GSPMD, driven by
the params' and KV pages' shardings.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import kernels
from ..model import ModelConfig, quant
from ..model.layers import use_device_hooks
from .experts import moe_shard
from .mesh import plan_of
from .plan import validate_plan
from .rules import axis_size, kv_cache_partition_spec, kv_heads_split, logical_to_spec

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # older JAX
    from jax.experimental.shard_map import shard_map


class MeshHooks:
    """What the model asks of the mesh (see `model.layers.device_hooks`)."""

    def __init__(self, config: ModelConfig, mesh: Mesh):
        self.config, self.mesh, self.plan = config, mesh, plan_of(mesh)
        validate_plan(config, self.plan)
        self.kv_split = kv_heads_split(config, self.plan)
        # XLA:CPU lacks the ragged all-to-all; an exact dense stand-in replaces it there.
        self.emulate_a2a = mesh.devices.flat[0].platform == "cpu"

    def _map(self, fn, in_specs, out_specs):
        return shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

    def constrain(self, x, logical_axes):
        spec = logical_to_spec(logical_axes, x.shape, self.plan)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def attention(self, attend, q, k, v, segment_ids=None, layer_cache=None, batch=None,
                  sinks=None):
        """attend(q, k, v, segment_ids, layer_cache, batch) -> (o, layer_cache), run once per
        tensor shard on its query heads, their kv heads and their KV pages. Dense inputs keep
        their batch split over "data"; a flat (paged) batch is whole on every shard. Per-head
        `sinks` [H] are split with the query heads."""
        lead = q.ndim - 2  # [B, T] dense, [T] flat
        batch_axis = None
        if layer_cache is None and q.shape[0] % self.plan.data == 0:
            batch_axis = "data"
        rows = (batch_axis,) + (None,) * (lead - 1)
        kv_axis = "tensor" if self.kv_split else None
        args = dict(q=q, k=k, v=v, segment_ids=segment_ids, layer_cache=layer_cache, batch=batch,
                    sinks=sinks)
        specs = dict(q=P(*rows, "tensor", None), k=P(*rows, kv_axis, None),
                     v=P(*rows, kv_axis, None), segment_ids=P(*rows), batch=P(), sinks=P("tensor"),
                     layer_cache=kv_cache_partition_spec(self.config, self.plan))
        args = {name: a for name, a in args.items() if a is not None}
        specs = {name: specs[name] for name in args}
        out_specs = (specs["q"], specs.get("layer_cache"))
        return self._map(partial(self._attend_shard, attend), (specs,), out_specs)(args)

    def mla_attention(self, attend, q_nope, q_pe, latent, k_pe, w_uk, w_uv, segment_ids=None,
                      layer_cache=None, batch=None):
        """Multi-head latent attention (`model.mla.mla_attend`) per tensor shard of query heads:
        queries, w_uk and w_uv split with their heads; the latent and RoPE key whole on every
        shard, each shard writing and reading its own copy of the latent pages."""
        lead = q_nope.ndim - 2
        batch_axis = None
        if layer_cache is None and q_nope.shape[0] % self.plan.data == 0:
            batch_axis = "data"
        rows = (batch_axis,) + (None,) * (lead - 1)
        heads, whole, by_head = P(*rows, "tensor", None), P(*rows, None), P(None, "tensor", None)
        args = dict(q_nope=q_nope, q_pe=q_pe, latent=latent, k_pe=k_pe, w_uk=w_uk, w_uv=w_uv,
                    segment_ids=segment_ids, layer_cache=layer_cache, batch=batch)
        specs = dict(q_nope=heads, q_pe=heads, latent=whole, k_pe=whole, w_uk=by_head,
                     w_uv=by_head, segment_ids=P(*rows), batch=P(),
                     layer_cache=kv_cache_partition_spec(self.config, self.plan))
        args = {name: a for name, a in args.items() if a is not None}
        specs = {name: specs[name] for name in args}

        def shard(a):
            with kernels.portable_backends(self.mesh.size > 1):
                return attend(a["q_nope"], a["q_pe"], a["latent"], a["k_pe"], a["w_uk"],
                              a["w_uv"], a.get("segment_ids"), a.get("layer_cache"),
                              a.get("batch"))
        return self._map(shard, (specs,), (heads, specs.get("layer_cache")))(args)

    def _attend_shard(self, attend, args):
        k, v = args["k"], args["v"]
        if not self.kv_split:  # this shard's query heads all read one kv head: keep only it
            tp, kv = self.plan.tensor, self.config.num_kv_heads
            head = jax.lax.axis_index("tensor") * kv // tp
            k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=k.ndim - 2)
            v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=v.ndim - 2)
        with kernels.portable_backends(self.mesh.size > 1):  # see there: Mosaic GPU off meshes
            sinks = {"sinks": args["sinks"]} if "sinks" in args else {}
            return attend(args["q"], k, v, args.get("segment_ids"), args.get("layer_cache"),
                          args.get("batch"), **sinks)

    def embed(self, table, tokens):
        """Vocabulary-parallel lookup: each tensor shard takes the tokens that fall in its rows
        of the table (zeros for the rest) and one all-reduce of [tokens, embed] sums them.
        Left to GSPMD, a decode step of one token gathered the whole table every step
        (docs/benchmarks/x2_run.md)."""
        if logical_to_spec(("vocab", "embed"), table.shape, self.plan)[0] != "tensor":
            return table[tokens]
        rows = P(*(("data",) if tokens.ndim == 2 and tokens.shape[0] % self.plan.data == 0
                   else (None,)), *(None,) * (tokens.ndim - 1))

        def lookup(table, tokens):
            local = tokens - jax.lax.axis_index("tensor") * table.shape[0]
            mine = (local >= 0) & (local < table.shape[0])
            x = table[jax.numpy.where(mine, local, 0)]
            return jax.lax.psum(jax.numpy.where(mine[..., None], x, 0), "tensor")
        return self._map(lookup, (P("tensor", None), rows), P(*rows, None))(table, tokens)

    def moe(self, x, router, w_gate, w_up, w_down, *, glu=None, router_bias=None, biases=None):
        """x [N, D] -> [N, D]: tokens split over data x expert, experts over expert, their MLP
        units over tensor (see `experts.py`). `glu`, `router_bias` and per-expert `biases`
        (b_gate, b_up, b_down) as `model.layers.MoE` takes them."""
        shards = self.plan.data * self.plan.expert
        n = x.shape[0]
        x = jax.numpy.pad(x, ((0, -n % shards), (0, 0)))  # every shard gets as many rows
        tokens = P(("data", "expert"), None)
        up, down = P("expert", None, "tensor"), P("expert", "tensor", None)
        size = partial(axis_size, self.plan)
        specs = (tokens, P(), quant.spec_for(w_gate, up, size), quant.spec_for(w_up, up, size),
                 quant.spec_for(w_down, down, size))
        fn = partial(moe_shard, config=self.config, ep=self.plan.expert, tp=self.plan.tensor,
                     emulate=self.emulate_a2a, glu=glu)
        args, specs = [x, router, w_gate, w_up, w_down], list(specs)
        if router_bias is not None:  # GPT-OSS's router bias, DeepSeek-V3's correction bias
            args, specs = args + [router_bias], specs + [P()]
        if biases is not None:
            args += list(biases)
            specs += [P("expert", "tensor"), P("expert", "tensor"), P("expert", None)]
        return self._map(fn, tuple(specs), tokens)(*args)[:n]


def with_mesh(fn, config: ModelConfig, mesh: Mesh):
    """`fn` with the mesh's device hooks installed while it runs; jit the result. The hooks are
    set inside the traced function, so its jit cache only ever holds traces made with them."""
    hooks = MeshHooks(config, mesh)

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with use_device_hooks(hooks):
            return fn(*args, **kwargs)

    return traced

