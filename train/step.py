"""The optimizer, the train state and the one jitted train step.

The state is a plain dict {step, params, opt_state, rng}: params are the fp32 master weights,
cast to the compute dtype (bf16 on GPU) inside the loss, so gradients and Adam moments stay fp32.
A step takes a batch [accum, B, T], sums the gradients of the micro-batches in a `lax.scan`
(gradient accumulation without a second optimizer state) and applies one AdamW update.
Params and optimizer moments live on the same shardings as inference params; the batch is split
over the mesh's "data" axis.

Distillation (`Distill`): with a teacher (a model of the same vocabulary, its params frozen and
passed to the step beside the batch), each token's objective mixes KL(teacher || student) of
their next-token distributions with the data's cross-entropy; the step also reports how often the
two models' argmaxes agree (what a speculative draft's proposals need).
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


@dataclasses.dataclass(frozen=True)
class Distill:
    """Train against a teacher: per token, weight * KL(teacher || student) at `temperature`
    (times temperature**2, so gradients keep their scale) + (1 - weight) * the data's
    cross-entropy."""
    config: ModelConfig  # the teacher's
    weight: float = 1.0
    temperature: float = 1.0


def distill_kl(student_logits, teacher_logits, temperature: float = 1.0):
    """KL(softmax(teacher / t) || softmax(student / t)) * t**2 per position [..., V] -> [...]."""
    t = temperature
    log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / t, axis=-1)
    log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / t, axis=-1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1) * (t * t)


def _logits(params, config, batch, compute_dtype):
    compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    return forward_logits(compute, config, batch["inputs"], batch["positions"],
                          batch["segment_ids"])


def loss_sums(params, config: ModelConfig, batch, compute_dtype, distill: Distill | None = None,
              teacher=None):
    """(sum of the masked per-token objective, sums {"tokens", "ce"; with a teacher also "kl",
    "agree"}) of a [B, T] batch. Without a teacher the objective is the cross-entropy."""
    logits = _logits(params, config, batch, compute_dtype)
    mask = batch["loss_mask"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    sums = {"tokens": jnp.sum(mask), "ce": jnp.sum(ce * mask)}
    objective = ce
    if distill is not None:
        t_logits = jax.lax.stop_gradient(_logits(teacher, distill.config, batch, compute_dtype))
        kl = distill_kl(logits, t_logits, distill.temperature)
        agree = jnp.argmax(logits, axis=-1) == jnp.argmax(t_logits, axis=-1)
        objective = distill.weight * kl + (1.0 - distill.weight) * ce
        sums.update(kl=jnp.sum(kl * mask), agree=jnp.sum(agree * mask))
    return jnp.sum(objective * mask), sums


def batch_first(batch):
    """The first micro-batch of a [accum, B, T] batch (shapes only matter)."""
    return jax.tree.map(lambda x: x[0], batch)


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

    def __init__(self, config: ModelConfig, hyper: Hyper, mesh, compute_dtype=jnp.float32,
                 distill: Distill | None = None, teacher_params=None):
        self.config, self.hyper, self.mesh = config, hyper, mesh
        self.compute_dtype, self.distill = compute_dtype, distill
        # The teacher's params: an input of the step and eval (not a constant baked into them).
        self.teacher, teacher_sh = {}, {}
        if distill is not None:
            if distill.config.vocab_size != config.vocab_size:
                raise ValueError(f"the teacher's vocabulary ({distill.config.vocab_size} tokens) "
                                 f"differs from the model's ({config.vocab_size} tokens)")
            teacher_sh = param_shardings(distill.config, mesh)
            self.teacher = jax.device_put(teacher_params, teacher_sh)
        self.optimizer = make_optimizer(hyper)
        self.lr = schedule(hyper)
        self.shapes = jax.eval_shape(self._init, param_shapes(config, jnp.float32), 0)
        self.shardings = state_shardings(config, mesh, self.optimizer, self.shapes)
        self.init = jax.jit(self._init, static_argnums=1, out_shardings=self.shardings)
        self._step_jit = jax.jit(self._step, donate_argnums=0, in_shardings=(
            self.shardings, batch_sharding(mesh), teacher_sh))
        self._eval_jit = jax.jit(self._eval, in_shardings=(
            self.shardings["params"], batch_sharding(mesh, accum=False), teacher_sh))

    def step(self, state, batch):
        return self._step_jit(state, batch, self.teacher)

    def eval(self, params, batch):
        """Sums over the batch: "objective", "tokens", "ce" (and "kl", "agree")."""
        return self._eval_jit(params, batch, self.teacher)

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

    def _loss(self, params, batch, teacher):
        return loss_sums(params, self.config, batch, self.compute_dtype, self.distill, teacher)

    def _step(self, state, batch, teacher):
        def micro(carry, mb):
            (loss, sums), grads = jax.value_and_grad(self._loss, has_aux=True)(
                state["params"], mb, teacher)
            return jax.tree.map(jnp.add, carry, (grads, loss, sums)), None

        sums0 = jax.eval_shape(lambda: self._loss(state["params"], batch_first(batch), teacher))[1]
        zeros = (jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros(()),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums0))
        (grads, loss, sums), _ = jax.lax.scan(micro, zeros, batch)
        count = jnp.maximum(sums["tokens"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        rng = jax.random.split(jax.random.wrap_key_data(state["rng"]))[0]
        new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
               "opt_state": opt_state, "rng": jax.random.key_data(rng)}
        metrics = {"loss": loss / count, "grad_norm": global_norm(grads),
                   "lr": self.lr(state["step"]), "tokens": sums["tokens"],
                   **{k: v / count for k, v in sums.items() if k != "tokens"}}
        return new, metrics

    def _eval(self, params, batch, teacher):
        objective, sums = self._loss(params, batch, teacher)
        return {"objective": objective, **sums}

    def put_batch(self, batch: dict[str, np.ndarray], accum: bool = True):
        """Place a host batch on the mesh (the batch axis must divide by the data axis)."""
        data = self.mesh.shape["data"]
        rows = next(iter(batch.values())).shape[1 if accum else 0]
        if rows % data:
            raise ValueError(f"batch size {rows} does not divide over the {data} devices of the "
                             "mesh's data axis")
        return jax.device_put(batch, batch_sharding(self.mesh, accum))

