"""Pricing context parallelism (the prefill ring) and pipeline parallelism (layer stages), and
when each wins.

CP (`sharding/context.py`): one prompt's tokens split over `cp` devices (zig-zag, so the causal
work is even). Each device runs the step on prompt / cp tokens and 1 / cp of the attention pairs
but reads every weight. Per layer the ring passes cp - 1 K/V blocks of prompt / cp tokens each;
each pass overlaps the attention of one ring step, so only what the link takes beyond that
compute shows. The new K/V then reach every device (pages replicated over cp): an all-gather
of (cp - 1) / cp of the prompt's KV.

PP: layers in `pp` stages (ceil split), micro-batches of the batch streamed through them. A
step of m micro-batches takes (m + pp - 1) stage times of the slowest stage: the bubble is
(pp - 1) / (m + pp - 1) and the imbalance is the slowest stage over the mean. Between stages
one activation [tokens, hidden] crosses a link per micro-batch. Memory per device: the stage's
layers (the first holds the embedding, the last the head), its KV pages. Decode is bound by
reading weights, so each micro-batch re-reads its stage's weights: a step in m micro-batches
costs m weight reads per stage. Steady serving keeps the pipe full across steps (the next
step's micro-batches enter as this step's leave), so its rate is one micro-batch per stage time.
"""

from __future__ import annotations

import dataclasses

from ...model import ModelConfig
from ...sharding import MeshPlan
from .inputs import GIB, Cluster, Workload, const
from .model import kv_bytes_per_token, shapes_of, step_cost


@dataclasses.dataclass
class CPCost:
    cp: int
    tp: int
    prompt: int
    compute_s: float  # the step on prompt / cp tokens (max of memory and compute, fixed costs)
    ring_bytes: float  # K/V bytes each device sends over the ring, all layers
    ring_s: float  # their link time, all layers
    ring_exposed_s: float  # what of it the attention does not hide
    kv_gather_s: float  # the new pages replicated over cp

    @property
    def ttft_s(self) -> float:
        return self.compute_s + self.ring_exposed_s + self.kv_gather_s


def cp_prefill(config: ModelConfig, cluster: Cluster, wl: Workload, prompt: int, cp: int,
               tp: int = 1) -> CPCost:
    """TTFT of one `prompt`-token prefill over cp x tp devices."""
    plan = MeshPlan(1, tp, 1)
    shapes = shapes_of(config, plan)
    tokens = -(-prompt // cp)
    pairs = prompt * (prompt + 1) / 2 / cp
    step = step_cost(config, shapes, plan, cluster, wl, tokens, 1, 0, pairs)
    kv_tok = kv_bytes_per_token(config, plan, wl.kv_bytes)  # K and V, all layers
    ring_bytes = (cp - 1) * tokens * kv_tok
    bw, lat = cluster.link(cp * tp)
    ring_s = ring_bytes / bw + (cp - 1) * lat * config.num_layers if cp > 1 else 0.0
    # The attention of one ring step runs while the next block moves.
    attn_s = step.attn_flops / (const("attn_tflops") * 1e12)
    exposed = max(0.0, ring_s - attn_s * (cp - 1) / cp) if cp > 1 else 0.0
    gather = (cp - 1) * tokens * kv_tok / bw + lat * config.num_layers if cp > 1 else 0.0
    return CPCost(cp, tp, prompt, step.time, ring_bytes, ring_s, exposed, gather)


@dataclasses.dataclass
class PPCost:
    pp: int
    tp: int
    micro_batches: int
    stage_layers: list
    stage_s: float  # the slowest stage on one micro-batch
    step_s: float  # one step of every micro-batch through every stage
    bubble: float  # share of device time idle in the fill and drain
    imbalance: float  # slowest stage / mean stage
    weights_gib: float  # the largest stage's weights on one device
    p2p_s: float  # activations between stages, per micro-batch and boundary
    batch: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens a second when each step fills and drains the pipe."""
        return self.batch / self.step_s

    @property
    def steady_tokens_per_s(self) -> float:
        """With the next step's micro-batches entering as this step's leave (no bubble): each
        stage time passes one micro-batch through."""
        return -(-self.batch // self.micro_batches) / self.stage_s


def stage_split(layers: int, pp: int) -> list[int]:
    """Layers per stage: as even as whole layers allow, the extra ones on the first stages."""
    return [layers // pp + (i < layers % pp) for i in range(pp)]


def pp_step(config: ModelConfig, cluster: Cluster, wl: Workload, batch: int, context: float,
            pp: int, tp: int = 1, micro_batches: int | None = None) -> PPCost:
    """One decode step of `batch` sequences (`context` cached tokens each) over pp stages of tp
    devices, in `micro_batches` (default pp) micro-batches."""
    m = micro_batches or pp
    plan = MeshPlan(1, tp, 1)
    shapes = shapes_of(config, plan)
    split = stage_split(config.num_layers, pp)
    per_layer = {k: v / config.num_layers for k, v in shapes.device.items()
                 if k not in ("embed", "head")}
    mb = -(-batch // m)
    one = step_cost(config, shapes, plan, cluster, wl, mb, mb, mb * context, mb * (context + 1))
    fixed = const("step_overhead_ms") * 1e-3
    layer_s = (one.time - fixed) / config.num_layers  # the step's per-layer share
    bw, lat = cluster.link(2)
    p2p = mb * config.hidden_size * wl.act_bytes / bw + lat if pp > 1 else 0.0
    stage_s = max(split) * layer_s + p2p
    step_s = (m + pp - 1) * stage_s + fixed
    mean = sum(split) / pp * layer_s + p2p
    weights = max(split) * sum(per_layer.values()) + max(shapes.device.get("embed", 0),
                                                         shapes.device.get("head", 0))
    return PPCost(pp, tp, m, split, stage_s, step_s, (pp - 1) / (m + pp - 1), stage_s / mean,
                  weights * wl.weight_bytes / GIB, p2p, batch)


def fits(config: ModelConfig, cluster: Cluster, wl: Workload, tp: int, pp: int = 1) -> bool:
    """Whether one device's share of the weights (plus the fixed workspace) fits its budget
    with room for KV pages (at least a quarter of it left)."""
    if config.num_heads % tp or tp > cluster.gpus_per_host:
        return False
    budget = cluster.gpu.memory_gib * GIB * const("mem_fraction")
    c = pp_step(config, cluster, wl, 1, 1, pp, tp)
    return c.weights_gib * GIB + const("workspace_gb") * 1e9 < 0.75 * budget


def recommend(config: ModelConfig, cluster: Cluster, wl: Workload, prompt: int,
              ttft_ms: float | None = None) -> dict:
    """CP: the smallest cp whose TTFT meets `ttft_ms` where one device's does not. PP: where no
    tensor size that divides the heads within one host fits, the fewest stages that do."""
    out = {}
    gpus = cluster.num_gpus
    one = cp_prefill(config, cluster, wl, prompt, 1)
    out["ttft_ms_one_device"] = one.ttft_s * 1e3
    if ttft_ms is not None and one.ttft_s * 1e3 > ttft_ms:
        for cp in [c for c in (2, 4, 8, 16) if c <= gpus]:
            c = cp_prefill(config, cluster, wl, prompt, cp)
            if c.ttft_s * 1e3 <= ttft_ms:
                out["cp"] = dict(cp=cp, ttft_ms=c.ttft_s * 1e3,
                                 ring_exposed_ms=c.ring_exposed_s * 1e3)
                break
    tps = [t for t in (1, 2, 4, 8) if t <= cluster.gpus_per_host and config.num_heads % t == 0]
    if not any(fits(config, cluster, wl, t) for t in tps):
        for pp in (2, 4, 8, 16):
            ok = [t for t in tps if t * pp <= gpus and fits(config, cluster, wl, t, pp)]
            if ok:
                out["pp"] = dict(pp=pp, tp=max(ok))
                break
    return out
