"""The sharding-plan explorer's model: presets, hardware, workload, and the per-plan memory,
FLOP, byte, communication and time estimates.

Parameter shapes come from `jax.eval_shape` of the model's init (`model.param_shapes`) and each
device's shard shape from the partition rules (`sharding.param_partition_specs` and
`sharding.shard_shape`), so the estimates follow the code. No device is touched.

Time model of one step on one replica (the devices of one data slice), per device:

    t_step = max(bytes / (hbm_bw * eff_hbm), mm_flops / (bf16 * eff_mm) + attn_flops / attn_rate)
             + comm + layers * layer_launch + step_overhead

`eff_*`, `layer_launch`, `step_overhead` and the rest live in CONSTANTS with their source.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np

from ...model import ModelConfig, config_from_dict, load_config
from ...sharding import MeshPlan, PlanError, param_partition_specs, shard_shape, validate_plan
from ...sharding.rules import _param_layout, kv_cache_heads

GB = 1e9
GIB = 2 ** 30

# -- presets -----------------------------------------------------------------------------------
# Hugging Face config.json fields of the public checkpoints (shapes only).
PRESETS = {
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192,
                        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    "qwen3-32b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1000000.0),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          rope_theta=1000000.0),
}


def load_model(name_or_path: str, num_layers: int | None = None) -> ModelConfig:
    """A preset name or a config.json path (file or folder); `num_layers` overrides the depth."""
    key = name_or_path.lower()
    if key in PRESETS:
        config = config_from_dict(PRESETS[key], name=key)
    elif Path(name_or_path).exists():
        config = load_config(name_or_path)
    else:
        raise ValueError(f"unknown model {name_or_path!r}: a config.json path or one of "
                         f"{sorted(PRESETS)}")
    if num_layers:
        config = config.replace(num_layers=num_layers, name=f"{config.name}-{num_layers}L")
    return config


# -- hardware ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # HBM as the device reports it
    hbm_tbps: float  # achievable copy bandwidth, bytes read + written per second / 1e12
    bf16_tflops: float  # dense bf16 matrix-product rate
    nvlink_gbps: float  # per-GPU NVLink bandwidth one way, GB/s
    nvlink_latency_us: float  # per collective hop
    source: str


# NVLink latency and link efficiency: from the collectives alone of benchmarks/bench_sharding.py on
# 2x H200, 2026-11-23 (docs/benchmarks/sharding.json, run 2026-11-23-B; all-reduce and
# all-to-all over the two GPUs, each op timed in a chain of 3 to 20 in one program,
# (t(n) - t(1)) / (n - 1)). Latency: the eight all-reduces of 4 KiB to 256 KiB, whose bytes take
# at most 1.2 us, took 6.7 to 21.4 us an op (16 KiB: 8.1, 17.5, 21.4; 128 KiB: 10.5, 16.3),
# median 15 us (run 2026-11-23-C: 8.4 to 20.6 us, median 15). Bandwidth: 64 MiB in 328.6 us,
# 214 GB/s after the latency, eff_link 0.48 of the 450 GB/s datasheet link (16 MiB: 80.6 us;
# the 64 MiB all-to-all, 33.6 MB crossing in 183 us, 0.44; run C's 64 MiB all-reduce took
# 411.9 us, 0.38). The H100 has the same NVLink 4 and is taken to be equal: no H100 pair
# measured yet. Inside a tp=2 decode step collectives take far longer than alone (at batch 1,
# one all-gather a step held GPU 0 for 3.8 ms in that run's trace): the model does not capture
# that (docs/plan.md, Results).
_NVLINK = "NVLink 450 GB/s one way: datasheet (900 GB/s bidirectional); latency 15 us: " \
          "all-reduce alone, 4 KiB to 256 KiB, 2x H200, docs/benchmarks/sharding.json run " \
          "2026-11-23-B (see the comment above GPUS)"
GPUS = {
    "h100": GPU("H100 SXM 80GB", 79.6, 2.98, 798.0, 450.0, 15.0,
                "memory 79.6 GiB: reported by the device; hbm 2.98 TB/s: torch copy_ measured "
                "by plan_validate's microbenchmark (copy_tbps 2.984, "
                "docs/benchmarks/plan_validation_x1.json, 2026-11-23; earlier H100s 3.00 to "
                "3.02: docs/benchmarks/probe_h100.json, moe.json); bf16 798 TFLOP/s: measured "
                "matmul (docs/kernels_notes.md); " + _NVLINK),
    "h200": GPU("H200 SXM 141GB", 139.8, 4.04, 798.0, 450.0, 15.0,
                "memory 139.8 GiB (141 GB): datasheet; HBM 4.04 TB/s: estimate, 0.84 of the "
                "4.8 TB/s datasheet (the H100's copy/datasheet ratio, 2.98/3.35, would give "
                "4.27; no H200 copy measured yet: plan_validate --devices 2 measures it, "
                "microbench copy_tbps); bf16: as the H100 (same SM, datasheet equal); "
                + _NVLINK),
}

# Calibration constants: value, source. One table so a measurement updates one place.
CONSTANTS = {
    "eff_hbm_weights": (0.85, "share of the copy ceiling an XLA matrix-vector product streams "
                              "weights at; with step_overhead_ms and layer_launch_us fit to the "
                              "Llama-3-8B batch-1 decode step, 7.15 ms for 16.13 GB "
                              "(docs/benchmarks/probe_h100.json)"),
    "eff_hbm_kv": (0.83, "paged decode kernel at 83% of the copy ceiling, B=64 ctx 4k "
                         "(docs/kernels_notes.md)"),
    "eff_matmul": (0.75, "estimate: XLA bf16 GEMMs of model shapes vs the 798 TFLOP/s peak"),
    "attn_tflops": (300.0, "estimate: ragged paged attention on prefill chunks; the flash "
                           "kernel reaches 390 causal TFLOP/s at S=4096 (docs/kernels_notes.md)"),
    "step_overhead_ms": (0.19, "fit: per-step fixed cost (launch of the step, logits, sync); "
                               "see eff_hbm_weights"),
    "layer_launch_us": (20.0, "fit: per-layer kernel launches and small ops (norms, RoPE, KV "
                              "write); see eff_hbm_weights"),
    "kv_fraction": (0.7, "share of the memory left after weights and workspace given to KV "
                         "pages: the engine's default (serving/llm.py default_num_pages)"),
    "eff_grouped": (0.3, "the Pallas grouped matmul of the MoE experts reaches 21% to 39% of its "
                         "floor at 256 to 2048 tokens (benchmarks/bench_moe.py, docs/BENCHMARKS.md)"),
    "eff_link": (0.48, "all-reduce bandwidth / NVLink one way: a 64 MiB all-reduce alone over "
                       "2x H200 in 328.6 us, 214 GB/s after the 15 us latency "
                       "(docs/benchmarks/sharding.json, run 2026-11-23-B; see GPUS)"),
    "mem_fraction": (0.75, "JAX preallocates 75% of GPU memory (XLA_PYTHON_CLIENT_MEM_FRACTION)"),
    "workspace_gb": (0.5, "estimate: memory compiling a step needs beyond the step (XLA's "
                          "autotuner runs GEMMs on scratch copies of their operands); "
                          "plan_validate measures it (compile_peak_gb)"),
    "gemm_workspace_mb": (32.0, "cuBLAS workspace of XLA's GEMMs on Hopper, in the step's temp "
                                "buffer: the size the cuBLAS docs recommend (cublasSetWorkspace)"),
}


def const(name: str) -> float:
    return CONSTANTS[name][0]


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_host: int = 8
    hosts: int = 1
    inter_host_gbps: float = 50.0  # per GPU, one way (400 Gb/s InfiniBand NIC per GPU)
    inter_host_latency_us: float = 15.0

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_host * self.hosts

    def link(self, group: int) -> tuple[float, float]:
        """(bytes/s, latency s) of one collective over `group` devices: NVLink inside a host,
        the inter-host network once the group spans hosts. The latency grows with the log of
        the group (tree / low-latency protocols for the small messages of decode)."""
        hops = max(1, math.ceil(math.log2(group)))
        if group <= self.gpus_per_host:
            lat, bw = self.gpu.nvlink_latency_us, self.gpu.nvlink_gbps
        else:
            lat, bw = self.inter_host_latency_us, self.inter_host_gbps
        return bw * GB * const("eff_link"), hops * lat * 1e-6


# -- workload ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Lengths:
    """Fixed (lo == hi) or uniform in lo..hi tokens."""
    lo: int
    hi: int

    @classmethod
    def parse(cls, text) -> "Lengths":
        lo, _, hi = str(text).partition(":")
        lo, hi = int(lo), int(hi or lo)
        if not 0 < lo <= hi:
            raise ValueError(f"lengths {text!r}: write N or LO:HI with 0 < LO <= HI")
        return cls(lo, hi)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclasses.dataclass(frozen=True)
class Workload:
    prompt: Lengths = Lengths(1024, 1024)
    output: Lengths = Lengths(256, 256)
    concurrency: int | None = None  # cap on sequences in flight (whole cluster)
    rate: float | None = None  # requests per second
    weight_bytes: int = 2
    kv_bytes: int = 2
    act_bytes: int = 2
    page_size: int = 16
    chunk: int = 2048  # prefill tokens per step (max_num_batched_tokens)
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def max_len(self) -> int:
        return self.prompt.hi + self.output.hi

    @property
    def mean_context(self) -> float:
        """Mean cached tokens of a decoding sequence: the prompt and half its output."""
        return self.prompt.mean + self.output.mean / 2


# -- the model's shapes, sharded -------------------------------------------------------------
def _flat(tree):
    import jax
    from jax.sharding import PartitionSpec as P
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]


@functools.lru_cache(maxsize=16)
def global_shapes(config: ModelConfig) -> dict:
    """Parameter name -> shape: the partition rules' own trace of the init (`jax.eval_shape`),
    so the names, shapes and specs line up leaf for leaf."""
    import jax
    treedef, shapes, _ = _param_layout(config)
    named = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, range(len(shapes))))
    return {jax.tree_util.keystr(k): tuple(shapes[i]) for k, i in named[0]}


def param_table(config: ModelConfig, plan: MeshPlan) -> list[dict]:
    """One row per parameter: name, global shape and this device's shard shape under `plan`."""
    import jax
    shapes = global_shapes(config)
    specs = _flat(param_partition_specs(config, plan))
    rows = []
    for key, spec in specs:
        name = jax.tree_util.keystr(key)
        shape = shapes[name]
        rows.append(dict(name=name, shape=tuple(shape), spec=spec,
                         shard=tuple(shard_shape(shape, spec, plan))))
    return rows


def _kind(name: str) -> str:
    """Which part of the step reads a parameter: embed (gathered rows), head, experts, other."""
    if "['embed']" in name:
        return "embed"
    if "['lm_head']" in name:
        return "head"
    if "['moe']" in name and "router" not in name:
        return "experts"
    return "dense"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the estimates need from the params: global and per-device element counts by kind."""
    total: int  # parameters of the whole model
    device: dict  # kind -> elements on one device
    glob: dict  # kind -> elements in the model

    @property
    def device_total(self) -> int:
        return sum(self.device.values())


def shapes_of(config: ModelConfig, plan: MeshPlan) -> Shapes:
    dev, glob = {}, {}
    for row in param_table(config, plan):
        kind = _kind(row["name"])
        dev[kind] = dev.get(kind, 0) + math.prod(row["shard"])
        glob[kind] = glob.get(kind, 0) + math.prod(row["shape"])
    return Shapes(sum(glob.values()), dev, glob)


# -- per-step cost --------------------------------------------------------------------------
@dataclasses.dataclass
class Step:
    """Work of one step on one device of a replica."""
    tokens: int  # new tokens on the flat axis (whole replica)
    hbm_bytes: float
    mm_flops: float
    attn_flops: float
    comm: dict  # collective -> (bytes per device per layer, seconds per layer)
    t_mem: float = 0.0
    t_compute: float = 0.0
    t_comm: float = 0.0
    t_fixed: float = 0.0
    t_experts: float = 0.0  # MoE experts, which do not overlap the rest of the step

    @property
    def time(self) -> float:
        return max(self.t_mem, self.t_compute) + self.t_comm + self.t_fixed + self.t_experts

    @property
    def bound(self) -> str:
        parts = {"memory": self.t_mem, "compute": self.t_compute, "communication": self.t_comm,
                 "overhead": self.t_fixed, "experts": self.t_experts}
        return max(parts, key=parts.get)


def kv_bytes_per_token(config: ModelConfig, plan: MeshPlan, kv_bytes: int) -> float:
    """K and V of one token, all layers, on one device (kv heads split or copied over tensor)."""
    heads = kv_cache_heads(config, plan) / plan.tensor
    return 2 * config.num_layers * heads * config.head_dim * kv_bytes


def experts_touched(config: ModelConfig, routed_tokens: int) -> float:
    """Expected share of experts a step reads when `routed_tokens` tokens pick top-k uniformly."""
    if not config.is_moe:
        return 1.0
    miss = (1 - config.num_experts_per_tok / config.num_experts) ** routed_tokens
    return 1 - miss


def collectives(config: ModelConfig, plan: MeshPlan, cluster: Cluster, tokens: int,
                act_bytes: int) -> dict:
    """Per layer: name -> (bytes each device sends, seconds). Tensor parallel: one all-reduce of
    the residual after attention and one after the MLP (ring: 2(t-1)/t of the message).
    Expert parallel: the routed rows go out and come back through all-to-alls."""
    out = {}
    t, e = plan.tensor, plan.expert
    msg = tokens * config.hidden_size * act_bytes
    if t > 1:
        bw, lat = cluster.link(t)
        sent = 2 * (t - 1) / t * msg
        out["all-reduce x2"] = (2 * sent, 2 * (sent / bw + lat))
    if e > 1:
        bw, lat = cluster.link(t * e)
        rows = tokens * config.num_experts_per_tok / e  # this shard's tokens' rows
        sent = rows * config.hidden_size * act_bytes * (e - 1) / e
        # counts all-gather (latency only) + dispatch + combine
        out["all-to-all x2"] = (2 * sent, 2 * (sent / bw + lat) + lat)
    return out


def embedding_all_reduce(config: ModelConfig, plan: MeshPlan, cluster: Cluster, tokens: int,
                         act_bytes: int) -> float:
    """Seconds of the step's one all-reduce outside its layers: with the vocabulary split over
    tensor, each shard looks up the rows it holds and the shards sum the [T, D] result (the
    compiled tp=2 step holds 2 L + 1 all-reduces)."""
    t = plan.tensor
    if t == 1 or config.vocab_size % t:
        return 0.0
    bw, lat = cluster.link(t)
    return 2 * (t - 1) / t * tokens * config.hidden_size * act_bytes / bw + lat


def step_cost(config: ModelConfig, shapes: Shapes, plan: MeshPlan, cluster: Cluster,
              wl: Workload, tokens: int, seqs: int, kv_read_tokens: float,
              attn_pairs: float) -> Step:
    """One step over `tokens` new tokens of `seqs` sequences on one replica.
    kv_read_tokens: cached tokens whose K/V the step reads (summed over sequences);
    attn_pairs: (query, key) pairs attended, summed over the replica's tokens."""
    t, e = plan.tensor, plan.expert
    # Weights read: everything but the embedding table (gathered rows) and the experts, which
    # are costed apart (experts_time: they run as their own products, not overlapped).
    w_elems = shapes.device.get("dense", 0) + shapes.device.get("head", 0)
    if config.tie_word_embeddings:
        w_elems += shapes.device.get("embed", 0)
    weight_bytes = w_elems * wl.weight_bytes
    kv_tok = kv_bytes_per_token(config, plan, wl.kv_bytes)
    hbm = weight_bytes + kv_read_tokens * kv_tok + tokens * kv_tok
    # Matrix FLOPs: 2 per weight per token on this device; experts see k of E per token and
    # their rows are spread over the expert shards; the head runs on the logits rows only.
    g = shapes.glob
    dense = g.get("dense", 0) / t
    head = g.get("head", g.get("embed", 0) if config.tie_word_embeddings else 0) / t
    mm = 2 * tokens * dense + 2 * seqs * head
    heads = config.num_heads / t
    attn = 4 * heads * config.head_dim * attn_pairs * config.num_layers
    comm = collectives(config, plan, cluster, tokens, wl.act_bytes)
    gpu = cluster.gpu
    step = Step(tokens, hbm, mm, attn, comm)
    w_time = weight_bytes / (gpu.hbm_tbps * 1e12 * const("eff_hbm_weights"))
    kv_time = (hbm - weight_bytes) / (gpu.hbm_tbps * 1e12 * const("eff_hbm_kv"))
    step.t_mem = w_time + kv_time
    step.t_compute = mm / (gpu.bf16_tflops * 1e12 * const("eff_matmul")) + \
        attn / (const("attn_tflops") * 1e12)
    step.t_comm = config.num_layers * sum(s for _, s in comm.values()) + \
        embedding_all_reduce(config, plan, cluster, tokens, wl.act_bytes)
    step.t_fixed = const("step_overhead_ms") * 1e-3 + \
        config.num_layers * const("layer_launch_us") * 1e-6
    if config.is_moe:
        step.t_experts = experts_time(config, shapes, plan, gpu, wl, tokens, step)
    return step


def experts_time(config: ModelConfig, shapes: Shapes, plan: MeshPlan, gpu, wl: Workload,
                 tokens: int, step: Step) -> float:
    """The MoE experts on one device, by the path the code takes (`expert_rows`): the Pallas
    grouped matmul reads only the experts routed to, each row meeting one expert, at
    eff_grouped of its floor; XLA's ragged_dot runs as a dense product of every row of its
    buffer (padding included) with every local expert (measured: its time is that weight read
    plus those FLOPs, one after the other)."""
    t, e, k, E = plan.tensor, plan.expert, config.num_experts_per_tok, config.num_experts
    local = shapes.device.get("experts", 0)  # elements of this device's experts
    buffer_rows, pallas = expert_rows(config, plan, tokens)
    bw = gpu.hbm_tbps * 1e12 * const("eff_hbm_weights")
    rate = gpu.bf16_tflops * 1e12
    if pallas:
        rows = tokens * k / e  # the rows routed to this device's experts (uniform routing)
        read = local * experts_touched(config, tokens) * wl.weight_bytes
        flops = 2 * rows * local * e / E  # each row meets one expert's weights
        t_exp = max(read / bw, flops / rate) / const("eff_grouped")
    else:
        flops = 2 * buffer_rows * local  # each row meets every local expert's weights
        read = local * wl.weight_bytes
        t_exp = read / bw + flops / (rate * const("eff_matmul"))
    step.hbm_bytes += read
    step.mm_flops += flops
    return t_exp


def prefill_step(config, shapes, plan, cluster, wl, seqs: int, prompt: int) -> Step:
    """`seqs` prompts of `prompt` tokens in one step (causal: token i attends to i + 1 keys)."""
    pairs = seqs * prompt * (prompt + 1) / 2
    return step_cost(config, shapes, plan, cluster, wl, seqs * prompt, seqs, 0, pairs)


def decode_step(config, shapes, plan, cluster, wl, seqs: int, context: float) -> Step:
    """One token for each of `seqs` sequences holding `context` cached tokens."""
    return step_cost(config, shapes, plan, cluster, wl, seqs, seqs, seqs * context,
                     seqs * (context + 1))


# -- memory ------------------------------------------------------------------------------------
def attention_splits(config: ModelConfig, plan: MeshPlan, tokens: int, seqs: int, context: int,
                     page_size: int) -> int:
    """Split-K factor the ragged paged attention kernel picks for this step (the rule of
    `kernels.ragged_paged_attention`, with the H100 tiles of `kernels.tuning`)."""
    from pallasite.kernels import tuning
    table = tuning.TABLE["H100"]
    tiles = table["decode" if tokens <= 2 * seqs else "ragged"]
    pages_per_block = max(1, tiles["block_k"] // page_size)
    kv = kv_cache_heads(config, plan) // plan.tensor
    group = config.num_heads // plan.tensor // kv
    rows = max(tiles["block_rows"], 16, group)
    blocks = max(-(-tokens * group // rows), seqs)
    key_tiles = -(-(-(-context // page_size)) // pages_per_block)
    want = max(1, table["splits"]["target_programs"] // max(1, blocks * kv))
    return int(max(1, min(want, table["splits"]["max_splits"], key_tiles)))


def expert_rows(config: ModelConfig, plan: MeshPlan, tokens: int) -> tuple[int, bool]:
    """(rows the device's expert products run over, whether they take the Pallas grouped
    kernel), as `sharding.experts` and `kernels.grouped_mlp` lay them out: a shard routes the k
    rows of its tokens / e tokens; with expert parallelism its receive buffer holds e times
    that. Below GROUPED_MIN_ROWS_PER_EXPERT rows per local expert, or with widths that are not
    whole 128-column tiles, XLA's ragged_dot runs."""
    from pallasite.kernels import GROUPED_MIN_ROWS_PER_EXPERT
    e = plan.expert
    rows = -(-tokens // e) * config.num_experts_per_tok * e
    tiles = (config.moe_intermediate_size // plan.tensor) % 128 == 0 and \
        config.hidden_size % 128 == 0
    return rows, tiles and rows >= GROUPED_MIN_ROWS_PER_EXPERT * (config.num_experts // e)


def _expert_bytes(config: ModelConfig, plan: MeshPlan, tokens: int, act_bytes: int) -> float:
    """The MoE layer's buffers: the sorted and the returned rows, and the products. The Pallas
    path pads each local expert's rows to whole blocks (`grouped_matmul.padded_rows`) and keeps
    the padded rows, their gate and up products; XLA's ragged_dot expands the rows over every
    local expert (masked copies of the rows, and their product) before it sums them."""
    from pallasite.kernels.grouped_matmul import block_m_for, padded_rows
    d, f = config.hidden_size, config.moe_intermediate_size / plan.tensor
    local = config.num_experts // plan.expert
    rows, pallas = expert_rows(config, plan, tokens)
    if pallas:
        padded = padded_rows(rows, local, block_m_for(rows, local))
        work = padded * (d + 2 * f)
    else:
        work = local * rows * (d + f)
    return (2 * rows * d + work) * act_bytes


def activation_parts(config: ModelConfig, plan: MeshPlan, tokens: int, seqs: int, context: int,
                     act_bytes: int = 2, page_size: int = 16) -> dict:
    """Bytes of one step's transient buffers on one device, by part, from the shapes the step
    makes (XLA reuses a layer's buffers for the next, so one layer's worth counts):

    stream     the residual [T, D], its norm and the sublayer's output (or its all-reduce)
    attention  q, k, v and the attention output [T, heads, hd]; split-K partials (f32)
    mlp        gate and up [T, F] (their product reuses one); MoE: see _expert_bytes
    logits     the head's product [S, V] in the weights' dtype and its f32 copy, plus the
               previous step's f32 logits, still held while the next step runs
    workspace  the GEMMs' cuBLAS workspace (gemm_workspace_mb)

    Attention and MLP run one after the other, so the step holds the larger."""
    t, a, hd, d = plan.tensor, act_bytes, config.head_dim, config.hidden_size
    heads = config.num_heads // t
    kv = kv_cache_heads(config, plan) // t
    attention = tokens * (2 * heads + 2 * kv) * hd * a
    splits = attention_splits(config, plan, tokens, seqs, context, page_size)
    if splits > 1:  # each split's normalized output and log-sum-exp, merged after
        attention += splits * tokens * heads * (hd + 1) * 4
    if config.is_moe:
        mlp = _expert_bytes(config, plan, tokens, a)
    else:
        mlp = 2 * tokens * (config.intermediate_size // t) * a
    vocab = config.vocab_size // t if config.vocab_size % t == 0 else config.vocab_size
    return dict(stream=3 * tokens * d * a, attention=attention, mlp=mlp,
                logits=seqs * vocab * (a + 4 + 4),
                workspace=const("gemm_workspace_mb") * 2 ** 20)


def activation_bytes(config: ModelConfig, plan: MeshPlan, tokens: int, seqs: int, context: int,
                     act_bytes: int = 2, page_size: int = 16) -> float:
    """Peak transient bytes of a step on one device (see activation_parts)."""
    p = activation_parts(config, plan, tokens, seqs, context, act_bytes, page_size)
    return p["stream"] + max(p["attention"], p["mlp"]) + p["logits"] + p["workspace"]


@dataclasses.dataclass
class Memory:
    budget: float  # bytes one device may use
    weights: float
    workspace: float  # activations of the largest step + fixed workspace
    kv_per_token: float
    kv_tokens: int = 0  # cache capacity
    kv_seqs: int = 0  # sequences of max_len that fit
    headroom: float = 0.0

    def to_dict(self):
        return {k: (round(v / GIB, 3) if k in ("budget", "weights", "workspace", "headroom")
                    else v) for k, v in dataclasses.asdict(self).items()} | {
            "kv_gib": round(self.kv_tokens * self.kv_per_token / GIB, 3)}


def memory(config, shapes, plan, cluster, wl, kv_fraction: float | None = None) -> Memory:
    """Per-device memory: weights (exact), the workspace of a full prefill chunk, and the KV
    cache in whole pages in what is left (`kv_fraction` of it)."""
    budget = cluster.gpu.memory_gib * GIB * const("mem_fraction")
    weights = shapes.device_total * wl.weight_bytes
    chunk = min(wl.chunk, max(wl.max_len, 1))
    work = activation_bytes(config, plan, chunk, max(1, chunk // wl.prompt.lo),
                            min(chunk, wl.prompt.hi), wl.act_bytes, wl.page_size) + \
        const("workspace_gb") * GB
    kv_tok = kv_bytes_per_token(config, plan, wl.kv_bytes)
    kv_fraction = const("kv_fraction") if kv_fraction is None else kv_fraction
    free = max(0.0, budget - weights - work) * kv_fraction
    pages = int(free // (kv_tok * wl.page_size))
    mem = Memory(budget, weights, work, kv_tok, pages * wl.page_size)
    per_seq = -(-wl.max_len // wl.page_size)
    mem.kv_seqs = pages // per_seq
    mem.headroom = budget - weights - work - pages * wl.page_size * kv_tok
    return mem


# -- plans -----------------------------------------------------------------------------------
def enumerate_plans(config: ModelConfig, num_gpus: int) -> list[MeshPlan]:
    """Every (data, tensor, expert) split of exactly `num_gpus` devices."""
    out = []
    for t in range(1, num_gpus + 1):
        for e in range(1, num_gpus // t + 1):
            if num_gpus % (t * e) == 0:
                out.append(MeshPlan(num_gpus // (t * e), t, e))
    return out


def batch_sizes(limit: int) -> list[int]:
    sizes = [b for b in (2 ** i for i in range(20)) if b <= limit]
    return sizes + ([limit] if limit > 0 and limit not in sizes else [])


def evaluate(config: ModelConfig, plan: MeshPlan, cluster: Cluster, wl: Workload) -> dict:
    """Everything the explorer reports for one plan; `status` is ok, invalid or no-fit."""
    rec = dict(plan=str(plan), data=plan.data, tensor=plan.tensor, expert=plan.expert)
    try:
        validate_plan(config, plan, cluster.num_gpus)
    except PlanError as err:
        return rec | dict(status="invalid", reason=str(err))
    shapes = shapes_of(config, plan)
    mem = memory(config, shapes, plan, cluster, wl)
    rec["memory_gib"] = mem.to_dict()
    if mem.kv_seqs < 1:
        need = mem.weights + mem.workspace + (-(-wl.max_len // wl.page_size)) * wl.page_size * \
            mem.kv_per_token
        short = need - mem.budget
        return rec | dict(status="no-fit", short_gib=round(short / GIB, 3), reason=(
            f"needs {need / GIB:.2f} GiB per GPU (weights {mem.weights / GIB:.2f}, workspace "
            f"{mem.workspace / GIB:.2f}, one {wl.max_len}-token sequence of KV) but "
            f"{mem.budget / GIB:.2f} GiB is usable: {short / GIB:.2f} GiB short"))
    rec.update(status="ok", **_performance(config, shapes, plan, cluster, wl, mem))
    return rec


def _step_dict(s: Step) -> dict:
    return dict(ms=s.time * 1e3, bound=s.bound, flops=s.mm_flops + s.attn_flops,
                hbm_bytes=s.hbm_bytes, mem_ms=s.t_mem * 1e3, compute_ms=s.t_compute * 1e3,
                comm_ms=s.t_comm * 1e3, overhead_ms=s.t_fixed * 1e3,
                comm_per_layer={k: dict(bytes=b, us=t * 1e6) for k, (b, t) in s.comm.items()})


def _performance(config, shapes, plan, cluster, wl, mem) -> dict:
    args = (config, shapes, plan, cluster, wl)
    p = int(wl.prompt.mean)
    prefill = prefill_step(*args, 1, p)
    # Per-token prefill costs, from a full chunk (what a loaded server runs).
    per_chunk = max(1, wl.chunk // p)
    chunk = prefill_step(*args, per_chunk, p)
    prefill_tok_s = chunk.time / (per_chunk * p)
    cap = mem.kv_tokens // max(1, math.ceil(wl.mean_context + wl.output.mean / 2))
    if wl.concurrency:
        cap = min(cap, max(1, wl.concurrency // plan.data))
    ttft = prefill.time + decode_step(*args, 1, p).time
    curve = []
    for b in batch_sizes(max(1, cap)):
        dec = decode_step(*args, b, wl.mean_context)
        # Steady state: every step also prefills the prompts of the b/output requests that
        # replace the finished ones, so prompts slow the step down.
        tpot = dec.time + b / wl.output.mean * p * prefill_tok_s
        curve.append(dict(batch=b, decode_ms=dec.time * 1e3, tpot_ms=tpot * 1e3,
                          tok_s=plan.data * b / tpot, bound=dec.bound))
    meets = [c for c in curve if wl.tpot_ms is None or c["tpot_ms"] <= wl.tpot_ms]
    best = max(meets, key=lambda c: c["tok_s"]) if meets else None
    rate_ok = None
    if wl.rate is not None:
        rate_ok = best is not None and best["tok_s"] >= wl.rate * wl.output.mean
    sla_ok = (wl.ttft_ms is None or ttft * 1e3 <= wl.ttft_ms) and best is not None
    d1 = decode_step(*args, 1, wl.mean_context)
    return dict(
        params_total=shapes.total, params_per_gpu=shapes.device_total,
        prefill=_step_dict(prefill) | dict(tokens=p, per_token_flops=prefill.mm_flops / p,
                                           per_token_hbm_bytes=prefill.hbm_bytes / p),
        ttft_ms=ttft * 1e3, prefill_ms_per_token_loaded=prefill_tok_s * 1e3,
        decode_batch1=_step_dict(d1), compute_bound_batch=_compute_bound_batch(args, wl.mean_context),
        compute_bound_batch_weights_only=_compute_bound_batch(args, 0),
        max_batch=cap, curve=curve, best=best, sla_ok=sla_ok, rate_ok=rate_ok,
        max_tok_s=max(c["tok_s"] for c in curve))


def _compute_bound_batch(args, context: float) -> int | None:
    """Smallest decode batch whose compute time reaches its memory time, at `context` cached
    tokens per sequence. None when it never does: each sequence's K/V reads then grow faster
    than its FLOPs (GQA attention does ~q_per_kv FLOPs per byte read)."""
    def compute_bound(b):
        s = decode_step(*args, b, context)
        return s.t_compute >= s.t_mem
    lo, hi = 1, 2 ** 20
    if not compute_bound(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not compute_bound(mid) else (lo, mid)
    return lo


def rank(records: list[dict]) -> list[dict]:
    """Fitting plans first: SLA met, then throughput at the best SLA batch, then TTFT; then the
    ones that do not fit, then the invalid ones."""
    def key(r):
        if r["status"] != "ok":
            return (2 if r["status"] == "no-fit" else 3, 0, 0)
        tok = r["best"]["tok_s"] if r["best"] else 0
        return (0 if r["sla_ok"] else 1, -tok, r["ttft_ms"])
    return sorted(records, key=key)


def explore(config: ModelConfig, cluster: Cluster, wl: Workload, plans=None) -> list[dict]:
    plans = plans or enumerate_plans(config, cluster.num_gpus)
    return rank([evaluate(config, p, cluster, wl) for p in plans])


def to_json(config: ModelConfig, cluster: Cluster, wl: Workload, records) -> str:
    head = dict(schema=1, model=config.name or config.model_type, params=None,
                gpu=cluster.gpu.name, gpus_per_host=cluster.gpus_per_host, hosts=cluster.hosts,
                workload=dataclasses.asdict(wl),
                constants={k: dict(value=v, source=s) for k, (v, s) in CONSTANTS.items()})
    ok = [r for r in records if r["status"] == "ok"]
    head["params"] = ok[0]["params_total"] if ok else None
    return json.dumps(head | dict(plans=records), indent=1, default=_plain)


def _plain(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)
