"""Context parallelism: one long prompt's prefill with its tokens split over a "cp" mesh axis.

The new tokens are laid out zig-zag (`ring.py`), padded to a multiple of 2 x cp; every layer's
token-wise work (projections, MLP, norms) runs on each device's own tokens, and attention runs
as a ring. A cached prefix (a prefix-cache hit) is read from the pages by every device for its
own queries and merged into the ring's result. This step's K/V are written into the layer's
pages at their slots, so the pages hold exactly what a one-device prefill leaves there and
decode runs over them as before. Params and KV pages are replicated over "cp".

The model sees this through the device hooks (`model.layers.use_device_hooks`) and the paged
`forward`: one sequence whose flat token axis is the zig-zag order.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import kernels
from ..kernels.flash_lse import flash_attention_lse
from ..kernels.reference import gather_pages
from ..model import Batch, ModelConfig, forward
from ..model.attention import pad_heads
from ..model.layers import moe_dispatch_combine, grouped_expert_mlp, route, use_device_hooks
from .ring import ring_attention, zigzag_order

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # older JAX
    from jax.experimental.shard_map import shard_map


def cp_mesh(n: int, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if n < 1 or n > len(devices):
        raise ValueError(f"context_parallel_size {n} needs 1..{len(devices)} devices")
    return Mesh(np.array(devices[:n]), ("cp",))


class ContextHooks:
    """Device hooks for a zig-zag prefill of one sequence over mesh axis "cp"."""

    def __init__(self, config: ModelConfig, mesh: Mesh, *, has_prefix: bool, attend=None):
        self.config, self.mesh, self.n = config, mesh, int(mesh.shape["cp"])
        self.has_prefix = has_prefix
        self.attend = attend or flash_attention_lse

    def constrain(self, x, logical_axes):
        """Activations on the flat token axis: each device keeps its own tokens."""
        if x.shape[0] % self.n:
            return x
        spec = P("cp", *(None,) * (x.ndim - 1))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def embed(self, table, tokens):
        return table[tokens]

    def moe(self, x, router, w_gate, w_up, w_down):
        c = self.config
        weights, experts = route(x, router, c.num_experts_per_tok, c.norm_topk_prob)
        fn = lambda xs, sizes: grouped_expert_mlp(xs, sizes, w_gate, w_up, w_down)
        return moe_dispatch_combine(x, weights, experts, c.num_experts, fn)

    def attention(self, attend, q, k, v, segment_ids=None, layer_cache=None, batch=None,
                  **sinks):
        """q [T, H, D] (zig-zag order), k/v [T, KV, D]; writes K/V into the pages, then the
        ring (plus the cached prefix) gives o [T, H, D]. The ring runs plain causal attention
        at the model's score scale (`attend`'s keywords): a layer with a window, a soft cap or
        sinks is refused, not computed without them."""
        if layer_cache is None or batch is None:
            raise ValueError("context-parallel prefill runs through the paged forward")
        options = dict(getattr(attend, "keywords", {}))
        extra = sorted({k for k, x in options.items() if x is not None} - {"sm_scale"}
                       | set(sinks))
        if extra:
            raise ValueError(f"context-parallel prefill runs plain causal attention; this "
                             f"model's layer also takes {extra}")
        new = batch.query_start[1] - batch.query_start[0]  # real new tokens
        cached = batch.context_lens[0] - new
        D = q.shape[-1]  # pages may be wider (`ModelConfig.page_head_dim`): pad to them
        q, k, v, options = pad_heads(layer_cache[0].shape[-1], q, k, v, **options)
        prefix = ()
        if self.has_prefix:  # the pages before this step's writes hold only the prefix
            prefix = tuple(gather_pages(pages, batch.page_table[:1]) for pages in layer_cache[:2])
        layer_cache = kernels.write_kv(*layer_cache, k, v, batch.slots)
        ring = partial(self._ring_shard, n=self.n, sm_scale=options.get("sm_scale"))
        specs = (P("cp"), P("cp"), P("cp"), P(), P(), (P(), P()) if prefix else ())
        o = shard_map(ring, mesh=self.mesh, in_specs=specs, out_specs=P("cp"),
                      check_vma=False)(q, k, v, new, cached, prefix)
        return o[..., :D].astype(q.dtype), layer_cache

    def _ring_shard(self, q, k, v, new, cached, prefix, *, n, sm_scale):
        q, k, v = q[None], k[None], v[None]
        part = None
        if prefix:  # every local query sees the whole cached prefix
            kp, vp = prefix
            pos = jnp.arange(kp.shape[1], dtype=jnp.int32)
            part = self.attend(q, kp, vp, jnp.full(q.shape[1], kp.shape[1], jnp.int32),
                               jnp.where(pos < cached, pos, -1), causal=False,
                               sm_scale=sm_scale)
        o, _ = ring_attention(q, k, v, axis="cp", n=n, causal=True, kv_len=new,
                              sm_scale=sm_scale, attend=self.attend, prefix=part)
        return o[0]


def _with_hooks(fn, hooks):
    @functools.wraps(fn)
    def traced(*args):
        with use_device_hooks(hooks):
            return fn(*args)
    return traced


class ContextParallel:
    """Prefill of one prompt over `mesh` ("cp"); params and KV pages replicated on it."""

    def __init__(self, config: ModelConfig, mesh: Mesh, page_size: int, *, attend=None):
        self.config, self.mesh, self.page_size = config, mesh, page_size
        self.n = int(mesh.shape["cp"])
        self.replicated = NamedSharding(mesh, P())
        self._steps = {}
        self._attend = attend

    def place(self, tree):
        return jax.device_put(tree, self.replicated)

    def _step(self, has_prefix: bool):
        if has_prefix not in self._steps:
            hooks = ContextHooks(self.config, self.mesh, has_prefix=has_prefix,
                                 attend=self._attend)
            c = self.config
            fn = _with_hooks(lambda p, t, pos, kv, b: forward(p, c, t, pos, kv, b), hooks)
            self._steps[has_prefix] = jax.jit(fn, donate_argnums=3)
        return self._steps[has_prefix]

    def inputs(self, tokens, page_table, cached: int = 0, bucket: int | None = None):
        """Host arrays for `prefill`: the new `tokens` (after `cached` prompt tokens already
        in the pages) in zig-zag order, padded to `bucket` (a multiple of 2 x cp; default the
        next one up)."""
        tokens = np.asarray(tokens, np.int32)
        n, L, ps = self.n, len(tokens), self.page_size
        size = bucket or -(-L // (2 * n)) * 2 * n
        if size < L or size % (2 * n):
            raise ValueError(f"bucket {size} must be >= {L} tokens and a multiple of {2 * n}")
        order = zigzag_order(size, n)
        pos = cached + order
        real = order < L
        table = np.asarray(page_table, np.int32)
        if (cached + L + ps - 1) // ps > len(table):
            raise ValueError(f"page table of {len(table)} pages is short of {cached + L} tokens")
        slots = np.where(real, table[np.minimum(pos // ps, len(table) - 1)] * ps + pos % ps, -1)
        tok = np.where(real, tokens[np.minimum(order, L - 1)], 0)
        last = int(np.nonzero(order == L - 1)[0][0])
        batch = Batch(np.array([0, L], np.int32), np.array([cached + L], np.int32), table[None],
                      slots.astype(np.int32), np.array([last], np.int32))
        return tok.astype(np.int32), np.where(real, pos, 0).astype(np.int32), batch

    def prefill(self, params, kv_cache, tokens, page_table, cached: int = 0, bucket=None):
        """Logits [1, vocab] of the prompt's last token, and the KV cache with every new
        token's K/V in its pages (donated)."""
        tok, pos, batch = self.inputs(tokens, page_table, cached, bucket)
        return self._step(cached > 0)(params, tok, pos, kv_cache, batch)
