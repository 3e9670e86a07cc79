"""The engine's sizes when the caller leaves them out: small on CPU, throughput-sized on a GPU.

On a GPU the KV pool takes most of the memory left after the weights, the sequence limit is as
many sequences as that pool holds at a few hundred tokens each (up to 1024), and each step may
carry 8192 tokens (decode rows first, prefill chunks in the rest). The token axis gets buckets
spaced by at most 1.5x from 256 rows up: a decode step is padded to its bucket, and above 256
rows a padded row costs compute that the step's weight and K/V reads no longer hide.
"""

from __future__ import annotations

import os

import jax

from ..kernels import W8A16_MAX_ROWS

CPU = dict(max_num_seqs=32, max_num_batched_tokens=512)
GPU_MAX_SEQS, GPU_BUDGET = 1024, 8192
TOKENS_PER_SEQ = 256  # KV tokens per sequence slot the GPU sizing plans for
# Offline batches on a GPU are paced (scheduler.py) at no fewer tokens a step than this: about
# where an 8B model's products take as long as the read of its weights on an H100 (bf16 at the
# clock the power cap holds; FP8 halves both). Chosen with benchmarks/pacing_model.py, then
# measured (docs/BENCHMARKS.md, ShareGPT).
PACE_TOKENS = 256
GPU_KV_FRACTION = 0.85  # of the memory free after the weights (the rest: activations, logits)


def page_bytes(config, page_size: int, dtype) -> int:
    from ..model.transformer import kv_bytes_per_token
    return page_size * kv_bytes_per_token(config, dtype)


def free_bytes(device=None) -> int | None:
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def default_num_pages(config, page_size: int, dtype, max_model_len: int, max_num_seqs: int,
                      fraction: float = 0.7) -> int:
    """Pages for a full context per sequence slot, capped at `fraction` of the device's free
    memory (the rest is for activations); where memory is not reported, uncapped."""
    one_seq = -(-max_model_len // page_size)
    want = max_num_seqs * one_seq
    free = free_bytes()
    if free is not None:
        return max(min(want, int(fraction * free // page_bytes(config, page_size, dtype))), one_seq)
    # No memory report (CPU): XLA:CPU copies the donated pool every step (measured: a 200 MB
    # pool makes a decode step 13x slower), so keep it to a few full contexts.
    return min(want, 4 * one_seq)


def coarse(n: int) -> int:
    """n rounded down to its 7 leading bits (within 1.6%): the pool's size, and so every
    program's shapes, stay the same from one start to the next although the free memory moves by
    a few megabytes, so the persistent compilation cache finds them."""
    drop = max(n.bit_length() - 7, 0)
    return n >> drop << drop


def gpu_token_buckets(budget: int, max_num_seqs: int, first: int = 2) -> list[int]:
    """Powers of two from `first` up to 256, then 1.5x / 2x steps (384, 512, 768, 1024, 1536,
    2048, ...) up to the budget; the sequence limit is a bucket too (a full decode step)."""
    out, b = [], first
    while b < min(256, budget):
        out.append(b)
        b *= 2
    b = 256
    while b < budget:
        out += [b, b * 3 // 2] if b * 3 // 2 < budget and b < 2048 else [b]
        b *= 2
    return sorted({*out, budget, min(max_num_seqs, budget)})


def default_pace(params=None) -> int | None:
    """`LLM()`'s pacing floor: PACE_TOKENS on a GPU; none on CPU, where steps are small, nor for
    integer weights with bf16 activations (W4A16, W8A16), whose products at a few hundred rows
    run at half bf16's rate: paced steps are that size, and made their ShareGPT run slower."""
    from ..model import quant_int
    if jax.default_backend() != "gpu" or "a16" in quant_int.describe(params or {}):
        return None
    return PACE_TOKENS


LAUNCH_THREAD_ENV = "PALLASITE_LAUNCH_THREAD"  # "1" / "0": steps launch on a thread, or not


def default_launch_thread() -> bool:
    """Whether an engine launches its steps on a thread of their own (launcher.py): on a GPU,
    where a launch costs milliseconds of the host's (docs/BENCHMARKS.md, "On an H200"), unless
    $PALLASITE_LAUNCH_THREAD is "0"; elsewhere only if it is "1"."""
    env = os.environ.get(LAUNCH_THREAD_ENV)
    return env == "1" if env in ("0", "1") else jax.default_backend() == "gpu"


def engine_sizes(config, dtype, *, max_model_len: int, page_size: int, num_pages=None,
                 max_num_seqs=None, max_num_batched_tokens=None, token_buckets=None,
                 first_bucket: int = 2) -> dict:
    """Fill in whatever the caller left as None. On CPU: today's small defaults. On a GPU: the
    KV pool from free memory, and the sequence limit, token budget and token buckets above."""
    if jax.default_backend() != "gpu":
        seqs = max_num_seqs or CPU["max_num_seqs"]
        budget = max_num_batched_tokens or max(CPU["max_num_batched_tokens"], seqs)
        pages = num_pages or default_num_pages(config, page_size, dtype, max_model_len, seqs)
        return dict(num_pages=pages, max_num_seqs=seqs, max_num_batched_tokens=budget,
                    token_buckets=token_buckets)
    one_seq = -(-max_model_len // page_size)
    if num_pages is None:
        free = free_bytes()
        num_pages = GPU_MAX_SEQS * one_seq
        if free is not None:
            fit = int(GPU_KV_FRACTION * free // page_bytes(config, page_size, dtype))
            num_pages = max(min(num_pages, coarse(fit)), one_seq)
    if max_num_seqs is None:
        fits = num_pages * page_size // TOKENS_PER_SEQ
        max_num_seqs = max(32, min(GPU_MAX_SEQS, 1 << max(fits, 1).bit_length() - 1))
    budget = max_num_batched_tokens or max(GPU_BUDGET, max_num_seqs)
    return dict(num_pages=num_pages, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                token_buckets=token_buckets or gpu_token_buckets(budget, max_num_seqs,
                                                                 first_bucket))


# -- XLA's options per program --------------------------------------------------------------
TRITON_GEMM_ENV = "PALLASITE_TRITON_GEMM"  # "1": XLA's Triton GEMMs kept at every step size
TRITON_GEMM_MAX_TOKENS = W8A16_MAX_ROWS  # so that no W8A8 product meets Triton's autotuning


def compiler_options(tokens: int | None = None) -> dict:
    """XLA options for an engine program of `tokens` rows (None: no matrix products to speak
    of). On a GPU, steps past TRITON_GEMM_MAX_TOKENS turn XLA's Triton GEMMs off: with them,
    XLA autotunes each FP8 product's Triton tiles at every token bucket (170 s to compile one
    8B layer at 8192 rows) and runs W8A8 at 1.03-1.29x bf16 where cuBLASLt runs it at
    1.33-1.50x; bf16 products time the same either way. Batch-1 steps keep them: there cuBLAS
    turns the one-row bf16 x bf16 -> float32 logits into a float32 copy of the LM head and a
    GEMV (1.7 ms a step against 0.35; H100, `benchmarks/w8a8_compile.py`,
    `profiling/profile_step.py`)."""
    if (jax.default_backend() != "gpu" or os.environ.get(TRITON_GEMM_ENV) == "1"
            or (tokens or 0) <= TRITON_GEMM_MAX_TOKENS):
        return {}
    return {"xla_gpu_enable_triton_gemm": False}


# -- the persistent compilation cache ---------------------------------------------------------
CACHE_ENV = "PALLASITE_CACHE_DIR"  # a folder; empty: no cache


def default_cache_dir() -> str:
    """$PALLASITE_CACHE_DIR if set (empty: off), else the per-user cache folder
    ($XDG_CACHE_HOME, or ~/.cache)/pallasite/xla."""
    if CACHE_ENV in os.environ:
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallasite", "xla")


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Keep compiled programs on disk so that the next start loads its warm-up instead of
    compiling it; returns the folder in use (None: off). `path` None takes `default_cache_dir()`;
    "" turns it off. A folder the caller already gave JAX is kept unless $PALLASITE_CACHE_DIR
    is set. Every program is stored whatever its compile time, so a second start compiles
    nothing."""
    current = jax.config.jax_compilation_cache_dir
    if current and path is None and CACHE_ENV not in os.environ:
        return current
    path = default_cache_dir() if path is None else path
    if not path:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
