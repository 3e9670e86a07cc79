"""Expert parallelism: each shard of the "expert" axis holds E/ep experts (their MLP units split
over "tensor") and a slice of the tokens. A shard routes its tokens, sends each (token, expert)
row to the shard owning that expert with one ragged all-to-all, runs a grouped matmul over what
it received, and sends the results back the same way. Only routed rows move; nothing is dropped,
so the result equals the one-device MoE up to float summation order.

The receive side is laid out grouped by local expert (sender-major within each expert), so the
grouped matmul needs no sort: every offset follows from one all-gather of the per-expert counts.
XLA:CPU has no ragged all-to-all, so there (tests) an exact stand-in pads each slice to the
largest it could be and uses a dense all-to-all.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..model.layers import grouped_expert_mlp, moe_dispatch_combine, route_tokens


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *, axis_name, axis_size, max_slice):
    """What `lax.ragged_all_to_all` computes, through a dense all-to-all of every slice padded
    to `max_slice` rows. Moves padding too: for backends without the ragged collective."""
    rows = jnp.arange(max_slice)
    src = jnp.clip(input_offsets[:, None] + rows, 0, operand.shape[0] - 1)
    slices = jnp.where((rows < send_sizes[:, None])[..., None], operand[src], 0)
    a2a = partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
    got, where = a2a(slices), a2a(output_offsets)  # slice i now came from shard i // per_shard
    dst = jnp.where(rows < recv_sizes[:, None], where[:, None] + rows, output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(-1, operand.shape[1]), mode="drop")


def remote_experts(x_sorted, group_sizes, w_gate, w_up, w_down, *, axis, ep, ragged_a2a,
                   glu=None, biases=None):
    """`expert_fn` for `moe_dispatch_combine` when experts live on other shards. x_sorted holds
    this shard's (token, expert) rows sorted by global expert, group_sizes [E] their counts."""
    n, e_local = x_sorted.shape[0], w_gate.shape[0]
    me = jax.lax.axis_index(axis)
    counts = jax.lax.all_gather(group_sizes, axis).reshape(ep, ep, e_local)  # [src, dst, local]
    excl = lambda c, ax: jnp.cumsum(c, axis=ax) - c
    per_expert = counts.sum(0)  # [dst, local]: rows each shard's experts receive
    # Where row block (src, expert) lands on its owner: its expert's group, after earlier senders.
    land = excl(per_expert, 1)[None] + excl(counts, 0)  # [src, dst, local]
    send_from = excl(group_sizes, 0)  # this shard's blocks, in global expert order
    recv_sizes = counts[:, me].reshape(-1)  # [src * local]
    received = ragged_a2a(x_sorted, jnp.zeros((ep * n, x_sorted.shape[1]), x_sorted.dtype),
                          send_from, group_sizes, land[me].reshape(-1), recv_sizes,
                          axis_name=axis)
    y = grouped_expert_mlp(received, per_expert[me], w_gate, w_up, w_down, glu, biases)
    # Back the same way: each block returns to where its sender sorted it.
    sent_from = excl(counts.reshape(ep, -1), 1).reshape(ep, ep, e_local)[:, me].reshape(-1)
    return ragged_a2a(y, jnp.zeros_like(x_sorted), land[:, me].reshape(-1), recv_sizes,
                      sent_from, group_sizes, axis_name=axis)


def moe_shard(x, router, w_gate, w_up, w_down, router_bias=None, b_gate=None, b_up=None,
              b_down=None, *, config, ep, tp, emulate, glu=None):
    """One shard's MoE over its tokens x [n, D]; weights are this shard's experts and units."""
    k = config.num_experts_per_tok
    weights, experts = route_tokens(config, x, router, router_bias)
    biases = None
    if b_gate is not None:  # the down bias once: the tensor shards' outputs are summed
        first = (jax.lax.axis_index("tensor") == 0) if tp > 1 else True
        biases = (b_gate, b_up, jnp.where(first, b_down, 0))
    if ep == 1:
        expert_fn = partial(grouped_expert_mlp, w_gate=w_gate, w_up=w_up, w_down=w_down,
                            glu=glu, biases=biases)
    else:
        a2a = jax.lax.ragged_all_to_all
        if emulate:
            a2a = partial(dense_ragged_all_to_all, axis_size=ep, max_slice=x.shape[0] * k)
        expert_fn = partial(remote_experts, w_gate=w_gate, w_up=w_up, w_down=w_down,
                            axis="expert", ep=ep, ragged_a2a=a2a, glu=glu, biases=biases)
    out = moe_dispatch_combine(x, weights, experts, config.num_experts, expert_fn)
    return jax.lax.psum(out, "tensor") if tp > 1 else out  # down-projection was split over F
