"""The optimizer, the train state and the one jitted train step.

The state is a plain dict {step, params, opt_state, rng}: params are the fp32 master weights,
cast to the compute dtype (bf16 on GPU) inside the loss, so gradients and Adam moments stay fp32.
A step takes a batch [accum, B, T], sums the gradients of the micro-batches in a `lax.scan`
(gradient accumulation without a second optimizer state) and applies one AdamW update.
Params and optimizer moments live on the same shardings as inference params; the batch is split
over the mesh's "data" axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from ..model import ModelConfig, forward_logits, param_shapes
from .mesh import param_shardings


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Optimization settings (hashable: part of the jitted step's identity)."""
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    total_steps: int = 1000
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0


def schedule(h: Hyper):
    """Linear warmup from 0 to lr, then cosine down to lr * min_lr_ratio at total_steps."""
    warmup = min(h.warmup_steps, max(h.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, h.lr, warmup, max(h.total_steps, warmup + 1),
                                              h.lr * h.min_lr_ratio)


def make_optimizer(h: Hyper) -> optax.GradientTransformation:
    # No weight decay on norm scales (the only 1-D params besides biases).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(h.clip),
        optax.adamw(schedule(h), h.b1, h.b2, weight_decay=h.weight_decay, mask=decay_mask))


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def loss_sums(params, config: ModelConfig, batch, compute_dtype):
    """(sum of masked next-token cross-entropies, number of loss tokens) of a [B, T] batch."""
    compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    logits = forward_logits(compute, config, batch["inputs"], batch["positions"],
                            batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["loss_mask"]), jnp.sum(batch["loss_mask"])


def state_shardings(config: ModelConfig, mesh, optimizer, state_shapes):
    """Shardings of the whole train state: Adam moments follow their params."""
    replicated = NamedSharding(mesh, P())
    params = param_shardings(config, mesh)
    opt = optax.tree_map_params(optimizer, lambda _, s: s, state_shapes["opt_state"], params,
                                transform_non_params=lambda _: replicated)
    return {"step": replicated, "params": params, "opt_state": opt, "rng": replicated}


def batch_sharding(mesh, accum: bool = True):
    """[accum, B, T] (or [B, T] for eval) split over "data" on the batch axis."""
    return NamedSharding(mesh, P(None, "data") if accum else P("data"))


class Trainer:
    """Jitted init, train and eval functions for one model, optimizer and mesh."""

    def __init__(self, config: ModelConfig, hyper: Hyper, mesh, compute_dtype=jnp.float32):
        self.config, self.hyper, self.mesh = config, hyper, mesh
        self.compute_dtype = compute_dtype
        self.optimizer = make_optimizer(hyper)
        self.lr = schedule(hyper)
        self.shapes = jax.eval_shape(self._init, param_shapes(config, jnp.float32), 0)
        self.shardings = state_shardings(config, mesh, self.optimizer, self.shapes)
        self.init = jax.jit(self._init, static_argnums=1, out_shardings=self.shardings)
        self.step = jax.jit(self._step, in_shardings=(self.shardings, batch_sharding(mesh)),
                            donate_argnums=0)
        self.eval = jax.jit(self._eval, in_shardings=(self.shardings["params"],
                                                      batch_sharding(mesh, accum=False)))

    def abstract_state(self):
        """The state's shapes, dtypes and shardings (what a checkpoint restores into)."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.shapes, self.shardings)

    def _init(self, params, seed: int):
        params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": self.optimizer.init(params),
                # Carried and saved so a resumed run continues any randomness exactly.
                "rng": jax.random.key_data(jax.random.key(seed))}

    def _step(self, state, batch):
        def micro(carry, mb):
            (loss, count), grads = jax.value_and_grad(loss_sums, has_aux=True)(
                state["params"], self.config, mb, self.compute_dtype)
            return jax.tree.map(jnp.add, carry, (grads, loss, count)), None

        zeros = (jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros(()), jnp.zeros(()))
        (grads, loss, count), _ = jax.lax.scan(micro, zeros, batch)
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        rng = jax.random.split(jax.random.wrap_key_data(state["rng"]))[0]
        new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
               "opt_state": opt_state, "rng": jax.random.key_data(rng)}
        metrics = {"loss": loss / count, "grad_norm": global_norm(grads),
                   "lr": self.lr(state["step"]), "tokens": count}
        return new, metrics

    def _eval(self, params, batch):
        return loss_sums(params, self.config, batch, self.compute_dtype)

    def put_batch(self, batch: dict[str, np.ndarray], accum: bool = True):
        """Place a host batch on the mesh (the batch axis must divide by the data axis)."""
        data = self.mesh.shape["data"]
        rows = next(iter(batch.values())).shape[1 if accum else 0]
        if rows % data:
            raise ValueError(f"batch size {rows} does not divide over the {data} devices of the "
                             "mesh's data axis")
        return jax.device_put(batch, batch_sharding(self.mesh, accum))

