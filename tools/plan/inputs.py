"""What the plan explorer judges a plan on: model presets (or a config.json), the GPUs and the
constants of the time model with their sources, the cluster, and the workload."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ...model import ModelConfig, config_from_dict, load_config

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
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408,
                             num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None,
                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                             num_experts_per_tok=6, first_k_dense_replace=1,
                             topk_method="greedy", max_position_embeddings=163840,
                             rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                           "beta_slow": 1, "mscale": 0.707,
                                           "mscale_all_dim": 0.707,
                                           "original_max_position_embeddings": 4096}),
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
    "eff_grouped_int": (0.1, "the grouped INT4 kernel of packed experts reaches 3% to 23% of its "
                             "INT4 floor at 1 to 256 tokens (benchmarks/bench_moe.py --bits 4, "
                             "docs/BENCHMARKS.md, H100 2026-11-26)"),
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


INT_BYTES = {"w4a16": 0.5 + 4 / 128, "w8a16": 1.0}  # a dense weight element, scales included


@dataclasses.dataclass(frozen=True)
class Workload:
    prompt: Lengths = Lengths(1024, 1024)
    output: Lengths = Lengths(256, 256)
    concurrency: int | None = None  # cap on sequences in flight (whole cluster)
    rate: float | None = None  # requests per second
    weight_bytes: int = 2
    quantization: str | None = None  # "fp8", "w4a16", "w8a16": as `--quantization` stores them
    kv_bytes: int = 2
    act_bytes: int = 2
    page_size: int = 16
    chunk: int = 2048  # prefill tokens per step (max_num_batched_tokens)
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def bytes_of(self, kind: str) -> float:
        """Bytes an element of a parameter kind ("dense", "experts", "head", "embed") takes, as
        quantize-on-load stores it: FP8 the linear layers (experts too) in one byte (float32
        per-channel scales add <0.1%); W4A16 the linear layers (experts too, one by one:
        `quant_int.quantize_params`) in half a byte plus a float32 scale per group of 128
        (symmetric: no zero points), W8A16 in one. The LM head and the embedding stay in the
        weights' dtype."""
        if self.quantization == "fp8" and kind in ("dense", "experts"):
            return 1
        if self.quantization in INT_BYTES and kind in ("dense", "experts"):
            return INT_BYTES[self.quantization]
        return self.weight_bytes

    @property
    def max_len(self) -> int:
        return self.prompt.hi + self.output.hi

    @property
    def mean_context(self) -> float:
        """Mean cached tokens of a decoding sequence: the prompt and half its output."""
        return self.prompt.mean + self.output.mean / 2
