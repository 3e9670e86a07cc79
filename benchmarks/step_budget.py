"""The time budget of one engine step: its roofline, the larger of its memory time and its compute
time.

  memory time  = (weights read + K/V read + K/V written) / copy bandwidth (measured in the run)
  compute time = FLOPs / the GPU's dense bf16 peak (twice that for the products of FP8 or
                 INT8 weights, which run on the 8-bit tensor cores)

A step reads every matmul weight once (the embedding table only where it is also the output
projection: otherwise only the scheduled tokens' rows are gathered), the K/V of every scheduled
sequence's context, and writes the K/V of its new tokens. Its FLOPs are the matmuls over its real
tokens (the output projection over the sampled rows only, as `forward` computes it) plus causal
attention: 4 * heads * head_dim per (query, key) pair per layer. Padding is not in the budget:
what padding costs shows as the gap to it.

The engine's step log gives what a step holds (`tokens`, `context_tokens`, `attended_tokens`,
`sampled_rows`); `budget(entry)` turns it into seconds.
"""

from __future__ import annotations

import dataclasses

# Dense bf16 tensor-core peak (FLOP/s), by the device kind JAX reports.
PEAK_BF16 = {"H100 80GB HBM3": 989.4e12, "NVIDIA H100 80GB HBM3": 989.4e12,
             "H100 SXM": 989.4e12, "H200": 989.4e12, "NVIDIA H200": 989.4e12,
             "H100 PCIe": 756.0e12, "NVIDIA H100 PCIe": 756.0e12}


def peak_bf16(device_kind: str) -> float | None:
    if device_kind in PEAK_BF16:
        return PEAK_BF16[device_kind]
    for name, flops in PEAK_BF16.items():  # "NVIDIA H100 80GB HBM3" and the like
        if name.split()[-1] in device_kind and ("PCIe" in name) == ("PCIe" in device_kind):
            return flops
    return None


@dataclasses.dataclass(frozen=True)
class ModelCost:
    body_params: int  # matmul weights applied to every token (all layers)
    head_params: int  # the output projection, applied to sampled rows
    weight_bytes: int  # read by every step
    kv_bytes_per_token: int  # K and V of one token, all layers
    attn_flops_per_pair: int  # per (query, key) pair, all layers
    body_rate: float = 1.0  # the body products' peak over the bf16 peak


# --quantization -> (bytes a body weight, scales included, and its products' rate over bf16):
# FP8 runs W8A8 on the FP8 tensor cores; the packed integer modes run bf16 products
QUANTIZED_BODY = {"fp8": (1.0, 2.0), "w8a16": (1.0, 1.0), "w4a16": (0.5 + 2 / 128, 1.0)}


def model_cost(config, itemsize: int = 2, kv_itemsize: int | None = None,
               body_itemsize: float | None = None, body_rate: float = 1.0) -> ModelCost:
    """The costs of a dense decoder from its config: weights of `itemsize` bytes, the body's
    products `body_itemsize` bytes a weight (scales included) at `body_rate` times the bf16
    peak (2: FP8 or INT8 on the 8-bit tensor cores)."""
    if config.num_experts:
        raise ValueError("the step budget counts dense models only (num_experts is "
                         f"{config.num_experts})")
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * config.intermediate_size
    body, head = config.num_layers * per_layer, config.vocab_size * d
    norms = (2 * config.num_layers + 1) * d
    kv_bytes = 2 * config.num_layers * kv * hd * (kv_itemsize or itemsize)
    body_bytes = int(body * (body_itemsize or itemsize))
    return ModelCost(body, head, body_bytes + (head + norms) * itemsize, kv_bytes,
                     4 * config.num_layers * h * hd, body_rate)


def attended_pairs(start: int, length: int) -> int:
    """(query, key) pairs of a causal chunk: token start + i sees start + i + 1 keys."""
    return length * start + length * (length + 1) // 2


def step_bytes(cost: ModelCost, tokens: int, context_tokens: int) -> int:
    return cost.weight_bytes + cost.kv_bytes_per_token * (context_tokens + tokens)


def step_flops(cost: ModelCost, tokens: int, attended: int, sampled_rows: int) -> float:
    """In bf16 FLOPs: the body's count divided by its tensor cores' rate over bf16's."""
    return (2 * cost.body_params * tokens / cost.body_rate + 2 * cost.head_params * sampled_rows
            + cost.attn_flops_per_pair * attended)


def budget(cost: ModelCost, entry: dict, bandwidth: float, peak: float) -> dict:
    """Seconds a logged step needs at best: memory, compute and their max (the roofline)."""
    memory = step_bytes(cost, entry["tokens"], entry["context_tokens"]) / bandwidth
    compute = step_flops(cost, entry["tokens"], entry["attended_tokens"],
                         entry["sampled_rows"]) / peak
    return dict(memory_s=memory, compute_s=compute, roofline_s=max(memory, compute))


def prefill_mfu(cost: ModelCost, entries_times, peak: float) -> float | None:
    """FLOP utilisation of the prefill tokens in mixed steps: their FLOPs over the time the step
    took beyond what its decode rows alone need at their roofline. `entries_times` are
    (entry, seconds, decode-only roofline seconds) of mixed steps."""
    flops = seconds = 0.0
    for entry, dt, decode_s in entries_times:
        prefill = entry["tokens"] - entry["decode_rows"]
        flops += (2 * cost.body_params * prefill / cost.body_rate
                  + cost.attn_flops_per_pair * (entry["attended_tokens"] - entry["decode_context"]))
        seconds += max(dt - decode_s, 1e-9)
    return flops / seconds / peak if seconds else None


def by_batch(rows: list[tuple[dict, float, dict]], edges=(1, 16, 64, 256, 512, 1024, 1 << 30)):
    """Group (entry, measured s, budget) by the step's row count: per group the median step,
    the mean roofline and its fraction (sum of rooflines over sum of step times), and the
    median host time and device wait of the calls that launched the steps."""
    import numpy as np
    out = []
    for lo, hi in zip(edges, edges[1:]):
        group = [(e, dt, b) for e, dt, b in rows if lo <= e["rows"] < hi]
        if not group:
            continue
        dts = [dt for _, dt, _ in group]
        roof = [b["roofline_s"] for _, _, b in group]
        out.append(dict(rows=f"{lo}-{hi - 1}" if hi < 1 << 30 else f">={lo}", steps=len(group),
                        step_ms=1e3 * float(np.median(dts)),
                        memory_ms=1e3 * float(np.mean([b["memory_s"] for _, _, b in group])),
                        compute_ms=1e3 * float(np.mean([b["compute_s"] for _, _, b in group])),
                        roofline_ms=1e3 * float(np.mean(roof)),
                        frac_of_roofline=sum(roof) / sum(dts),
                        **{f"{k}_ms": 1e3 * float(np.median([e.get(f"{k}_s", np.nan)
                                                             for e, _, _ in group]))
                           for k in ("host", "wait")}))
    return out
