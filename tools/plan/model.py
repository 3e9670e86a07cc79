"""The sharding-plan explorer's model: per plan, the memory, FLOP, byte, communication and time
estimates of a step.

Parameter shapes come from `jax.eval_shape` of the model's init (`model.param_shapes`) and each
device's shard shape from the partition rules (`sharding.param_partition_specs` and
`sharding.shard_shape`), so the estimates follow the code. No device is touched.

Time model of one step on one replica (the devices of one data slice), per device:

    t_step = max(bytes / (hbm_bw * eff_hbm), mm_flops / (bf16 * eff_mm) + attn_flops / attn_rate)
             + comm + layers * layer_launch + step_overhead

`eff_*`, `layer_launch`, `step_overhead` and the rest live in CONSTANTS (`inputs.py`) with their
source.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ...kernels import INT4_HOPPER_MAX_ROWS, INT_MATMUL_MAX_ROWS, W8A16_MAX_ROWS
from ...model import ModelConfig
from ...sharding import MeshPlan, param_partition_specs, shard_shape
from ...sharding.rules import _param_layout, kv_cache_heads
from .inputs import GB, GIB, INT_BYTES, Cluster, Workload, const


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
    _, shapes, _, paths = _param_layout(config)
    return {jax.tree_util.keystr(k): tuple(shape) for k, shape in zip(paths, shapes)}


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
    if "['moe']" in name and not any(s in name for s in ("router", "score_bias", "shared")):
        return "experts"  # DeepSeek's shared experts run on every token: dense
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
    """K and V of one token, all layers, on one device (kv heads split or copied over tensor);
    MLA: its latent and RoPE key, a copy on every tensor shard."""
    heads = kv_cache_heads(config, plan) / plan.tensor
    return config.num_layers * heads * sum(config.kv_arrays) * kv_bytes


def attn_flops_per_pair(config: ModelConfig) -> int:
    """FLOPs per (query, key) pair and query head: q.k and p.v over head_dim each; MLA's
    absorbed form scores over latent + RoPE dims and sums latent-wide values."""
    if config.is_mla:
        return 2 * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
    return 4 * config.head_dim


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
    kinds = ("dense", "head") + (("embed",) if config.tie_word_embeddings else ())
    weight_bytes = sum(shapes.device.get(kind, 0) * wl.bytes_of(kind) for kind in kinds)
    rows = INT4_HOPPER_MAX_ROWS if wl.quantization == "w4a16" else INT_MATMUL_MAX_ROWS
    if wl.quantization in INT_BYTES and tokens > rows:
        # above the kernel's rows the integer weights are dequantized to bf16 (written, then
        # read by XLA's dot) every step: prefill is compute-bound, but these bytes still move
        weight_bytes += shapes.device.get("dense", 0) * 2 * wl.weight_bytes
    kv_tok = kv_bytes_per_token(config, plan, wl.kv_bytes)
    hbm = weight_bytes + kv_read_tokens * kv_tok + tokens * kv_tok
    # Matrix FLOPs: 2 per weight per token on this device; experts see k of E per token and
    # their rows are spread over the expert shards; the head runs on the logits rows only.
    g = shapes.glob
    dense = g.get("dense", 0) / t
    head = g.get("head", g.get("embed", 0) if config.tie_word_embeddings else 0) / t
    mm = 2 * tokens * dense + 2 * seqs * head
    heads = config.num_heads / t
    attn = heads * attn_flops_per_pair(config) * attn_pairs * config.num_layers
    comm = collectives(config, plan, cluster, tokens, wl.act_bytes)
    gpu = cluster.gpu
    step = Step(tokens, hbm, mm, attn, comm)
    w_time = weight_bytes / (gpu.hbm_tbps * 1e12 * const("eff_hbm_weights"))
    kv_time = (hbm - weight_bytes) / (gpu.hbm_tbps * 1e12 * const("eff_hbm_kv"))
    step.t_mem = w_time + kv_time
    # FP8 weights: steps of more than W8A16_MAX_ROWS tokens run the dense products FP8 x FP8
    # (twice the bf16 rate on Hopper); smaller ones, and the head, run in bf16.
    fp8_mm = wl.quantization == "fp8" and tokens > W8A16_MAX_ROWS
    dense_mm = 2 * tokens * dense / (2 if fp8_mm else 1)
    step.t_compute = (dense_mm + 2 * seqs * head) / (gpu.bf16_tflops * 1e12 * const("eff_matmul")) \
        + attn / (const("attn_tflops") * 1e12)
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
    plus those FLOPs, one after the other). Packed integer experts always take their grouped
    kernel (`kernels/grouped_int.py`), at eff_grouped_int of its floor."""
    t, e, k, E = plan.tensor, plan.expert, config.num_experts_per_tok, config.num_experts
    local = shapes.device.get("experts", 0)  # elements of this device's experts
    buffer_rows, pallas = expert_rows(config, plan, tokens)
    packed = wl.quantization in INT_BYTES
    pallas = pallas or packed
    bw = gpu.hbm_tbps * 1e12 * const("eff_hbm_weights")
    rate = gpu.bf16_tflops * 1e12
    if pallas:
        rows = tokens * k / e  # the rows routed to this device's experts (uniform routing)
        read = local * experts_touched(config, tokens) * wl.bytes_of("experts")
        flops = 2 * rows * local * e / E  # each row meets one expert's weights
        t_exp = max(read / bw, flops / rate) / const("eff_grouped_int" if packed
                                                       else "eff_grouped")
    else:
        flops = 2 * buffer_rows * local  # each row meets every local expert's weights
        read = local * wl.bytes_of("experts")
        t_exp = read / bw + flops / (rate * const("eff_matmul"))
    step.hbm_bytes += read
    step.mm_flops += flops
    return t_exp


def windowed(config: ModelConfig, keys: float) -> float:
    """The keys a query that could see `keys` attends to, averaged over the layers: a sliding
    layer sees at most its window (the kernels read no page wholly outside it)."""
    sees = [min(keys, config.window(i) or keys) for i in range(config.num_layers)]
    return sum(sees) / config.num_layers


def causal_pairs(config: ModelConfig, prompt: int) -> float:
    """(query, key) pairs of one causal prompt, averaged over the layers: token i attends to
    i + 1 keys, or to a sliding layer's window."""
    def pairs(w):
        w = min(w or prompt, prompt)
        return w * (w + 1) / 2 + (prompt - w) * w
    return sum(pairs(config.window(i)) for i in range(config.num_layers)) / config.num_layers


def prefill_step(config, shapes, plan, cluster, wl, seqs: int, prompt: int) -> Step:
    """`seqs` prompts of `prompt` tokens in one step (causal, within each layer's window)."""
    pairs = seqs * causal_pairs(config, prompt)
    return step_cost(config, shapes, plan, cluster, wl, seqs * prompt, seqs, 0, pairs)


def decode_step(config, shapes, plan, cluster, wl, seqs: int, context: float) -> Step:
    """One token for each of `seqs` sequences holding `context` cached tokens (of which each
    sliding layer reads its window)."""
    return step_cost(config, shapes, plan, cluster, wl, seqs, seqs,
                     seqs * windowed(config, context), seqs * windowed(config, context + 1))


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
    if config.is_mla:  # absorbed queries and outputs are latent-wide
        hd = sum(config.kv_arrays)
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


def held_pages(config: ModelConfig, max_len: int, chunk: int, page_size: int) -> int:
    """KV pages a sequence holds at most: all of its length, or where every layer slides (the
    engine frees the pages its window has passed, `serving/kv_window.py`) a window plus a
    prefill chunk, and a page for the window's unaligned start."""
    full = -(-max_len // page_size)
    windows = [config.window(i) for i in range(config.num_layers)]
    if None in windows or config.is_mla:
        return full
    return min(full, -(-(max(windows) + chunk) // page_size) + 1)


def memory(config, shapes, plan, cluster, wl, kv_fraction: float | None = None) -> Memory:
    """Per-device memory: weights (exact), the workspace of a full prefill chunk, and the KV
    cache in whole pages in what is left (`kv_fraction` of it)."""
    budget = cluster.gpu.memory_gib * GIB * const("mem_fraction")
    weights = sum(n * wl.bytes_of(kind) for kind, n in shapes.device.items())
    chunk = min(wl.chunk, max(wl.max_len, 1))
    work = activation_bytes(config, plan, chunk, max(1, chunk // wl.prompt.lo),
                            min(chunk, wl.prompt.hi), wl.act_bytes, wl.page_size) + \
        const("workspace_gb") * GB
    kv_tok = kv_bytes_per_token(config, plan, wl.kv_bytes)
    kv_fraction = const("kv_fraction") if kv_fraction is None else kv_fraction
    free = max(0.0, budget - weights - work) * kv_fraction
    pages = int(free // (kv_tok * wl.page_size))
    mem = Memory(budget, weights, work, kv_tok, pages * wl.page_size)
    per_seq = held_pages(config, wl.max_len, chunk, wl.page_size)
    mem.kv_seqs = pages // per_seq
    mem.headroom = budget - weights - work - pages * wl.page_size * kv_tok
    return mem
