"""Block sizes per GPU, chosen by `benchmarks/bench_kernels.py --sweep` runs (see docs/kernels_notes.md).

Keys are matched as substrings of `jax.devices()[0].device_kind`; "default" serves any other GPU
and interpret mode. `target_programs` is how many (block, kv head, split) programs the split-K
heuristic aims for: a few per SM, so a batch-1 long-context decode still fills the GPU.

That heuristic reads the whole call's shape, so a row's sums depend on the batch around it.
Inside `batch_invariant()` the paged attention kernels cut keys into splits of a fixed
`invariant_keys` instead: a row's result then depends only on its own context (speculative
verification checks k tokens in one step and must score each as a decode step would).
`batch_invariant(True)` fixes the matrix products' order too (`invariant_matmul.py`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

# Keys per K/V tile (`block_k`) become pages_per_block = block_k // page_size at the call.
_DEFAULT = {
    "flash": dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    "flash_d64": dict(block_q=128, block_k=64, num_warps=4, num_stages=3),
    # Mosaic GPU flash (Hopper): block_q rows per consumer warpgroup, two per CTA.
    "flash_mosaic": dict(block_q=64, block_kv=128, num_stages=2),
    "decode": dict(block_rows=16, block_k=128, num_warps=4, num_stages=2, prefetch_pages=True),
    "ragged": dict(block_rows=64, block_k=128, num_warps=4, num_stages=2, prefetch_pages=True),
    # Decode over float8 pages (paged.py `fp8_dot`): tiles converted to f16 in one step, f16
    # MMAs. H100, 2026-11-25 (benchmarks/sweep_fp8kv.py): the fastest of 9 variants at B=64/4k,
    # B=8/8k and 768 ShareGPT-like rows; the CUDA-core products ("fma", "fma_rows") lost 1.5-10x.
    # Two stages, 2026-11-26: 0.3135 / 0.0858 / 0.3814 ms at those shapes against three's 0.3168
    # / 0.0898 / 0.3936 (64-key tiles win only at 768 rows, 0.347, and lose 1.06-1.5x elsewhere).
    "decode_fp8": dict(block_rows=16, block_k=128, num_warps=4, num_stages=2, prefetch_pages=True,
                       fp8_dot="f16"),
    # Mosaic GPU decode (Hopper; "decode_backend" says where it is the default). H100 and H200
    # sweeps of 2026-11-23 (benchmarks/sweep_decode.py), batch 1 at 32k: 128-key tiles, 2 stages,
    # 16 splits best on both (69.6 / 53.8 us); 64-key tiles 70.6-78.7 / 56.8-75.1 us.
    "decode_mosaic": dict(block_k=128, num_stages=2),
    # H100 sweep (B=1, ctx 32k): 16 splits of 3-4 stage pipelines beat 64 short ones (71 vs
    # 83 us): a program needs enough key tiles to fill its pipeline. Two programs per SM: at
    # batch 8-32 (ctx 256-32k, `sweep_decode.py --short`) 264 beat the 528 it replaced, e.g.
    # batch 16 / 1k 37.7 vs 41.4 us, batch 32 / 4k 0.195 vs 0.199 ms, batch 8 / 4k 62.8 vs 64.6
    # us; batch 1 still takes 16 splits. Mixed prefill + decode steps aim for more programs:
    # the bench's 512-token chunk + 63 decode tokens takes 0.261 ms in 2 splits against 0.299 in
    # 1 and 0.272 in 4 (H100; H200 0.236 / 0.289 / 0.246).
    # Batch-invariant splits: 512 keys each, so a batch-1 decode has 2 splits a kv head at 640
    # tokens of context and 64 at 32k (where the heuristic's 16 measured 71 us against 83 for
    # 64, on the H100). On the H100's decode grid they cost nothing measurable (0.99-1.01x the
    # heuristic's time, 2026-11-26); a long prefill chunk writes and reads a float32 partial
    # output per split.
    # A mixed step's split takes 8 key tiles at least: a 247-token chunk over 647 keys and 9
    # decode rows (10 tiles of 64 keys) took 0.0520 ms a layer in the 8 splits the target
    # asked for, 0.0368 / 0.0324 / 0.0300 in 4 / 2 / 1 (H200, 2026-11-28, `sweep_ragged
    # --cases tail --splits 1,2,4`).
    "splits": dict(target_programs=264, target_programs_mixed=1056, max_splits=16,
                   min_tiles_mixed=8, invariant_keys=512),
    # The step's K/V rows into their pages: "xla" (a scatter per array) or "pallas" (one launch).
    "kv_write": dict(impl="xla"),
    # A fused projection's RoPE and page write (`rope_kv.py`, where kv_write takes "pallas"):
    # tokens a program. H200, 2026-11-29 (`benchmarks/bench_rope_kv.py`, Llama-3-8B heads): one
    # token in four warps was the fastest of four at 1-8192 tokens, 2.8-48.8 us against XLA's
    # passes' 4.1-92.0 on bf16 pages (8192 tokens: 200 MB moved at 4.1 TB/s). The H100, whose
    # KV write is "pallas" too, takes it unmeasured.
    "rope_kv": dict(tokens=1, num_warps=4),
}

# H100 80GB HBM3, JAX 0.11.2, `benchmarks/bench_kernels.py --sweep`: the best flash tiles at B=4,
# S=4096, causal (2026-11-22); the best decode tiles over (B=64, ctx 4k) and (B=1, ctx 32k)
# (2026-11-23: 64-key tiles, 3 stages, 0.386 ms at B=64 ctx 4k against 0.435 for 128 keys and 2).
# block_rows=64 lets Triton use warpgroup MMAs even for decode (rows past the group are masked).
_H100 = dict(
    _DEFAULT,
    flash=dict(block_q=128, block_k=128, num_warps=8, num_stages=3),
    decode=dict(block_rows=64, block_k=64, num_warps=4, num_stages=3, prefetch_pages=True),
    ragged=dict(block_rows=64, block_k=64, num_warps=4, num_stages=3, prefetch_pages=True),
    # One Pallas launch for K and V (after XLA stacks them) against XLA's two scatters, in
    # place (2026-11-23, 8 kv heads, d=128): 2.9 vs 7.1 us for 1 token, 3.4 vs 4.9 for 64, 15.8
    # vs 44.1 for 2048; the serving step's kernels 0.05-0.1 ms shorter (docs/BENCHMARKS.md).
    kv_write=dict(impl="pallas"),
    # Mixed and prefill steps whose page table reaches `min_keys` keys run the Mosaic GPU ragged
    # kernel (`paged_mgpu.ragged_paged_attention`); narrower ones the Triton kernel. H100,
    # 2026-11-26 (`benchmarks/sweep_ragged.py --mosaic`, 128-key tiles, 2 stages, 1 split, the
    # best of seven): a 512-token chunk over 8k + 63 decode rows at 4k 0.438 ms against Triton's
    # 0.502 and FA3's 0.497; the chunk alone 0.191 against 0.251; a 2048-token prompt 0.156
    # against 0.173; but the offline ShareGPT mixed step (512 decode rows at 320 keys, 30 chunks
    # of 256) 0.633 against 0.408: short contexts leave each CTA too little to do. The H200
    # inherits this entry unmeasured.
    ragged_mosaic=dict(block_k=128, num_stages=2, num_splits=1, min_keys=4096),
    # Mixed steps over float8 pages (the Triton kernel at every reach): the ragged tiles with the
    # tiles made float16 in one conversion, not bf16 through float32 ("q"). H200, 2026-11-28
    # (`sweep_ragged --fp8 --library --fp8-dots f16,f16_swap,e4m3 --pad-seqs 256`): a paced step
    # with its decode rows first 0.1418 ms against 0.1535, a paced run's last step 0.0421
    # against 0.0778; 16-row tiles 0.1364 / 0.0779, "e4m3" and "f16_swap" slower at 64 rows.
    # The H100 shares the SM and its conversions; it was not measured there.
    ragged_fp8=dict(block_rows=64, block_k=64, num_warps=4, num_stages=3, prefetch_pages=True,
                    fp8_dot="f16"),
)

# H200, JAX 0.11.2, `benchmarks/sweep_decode.py` and `bench_kernels.py` (2026-11-23,
# docs/benchmarks/h200_*): the Mosaic GPU decode kernel's TMA page copies lead at batch 1 / 32k
# (46.4 vs 53.2 us, device time), are level at batch 64 / 4k (0.266 vs 0.265 ms) and trail by 8%
# at batch 64-256 / 1k; on the H100 the Triton kernel is level or ahead. The H200's own
# `--sweep --sweep-parts mosaic,decode` chose the H100's flash and decode tiles again.
# At short tables it is the slower: 200 rows at 400 keys 0.1412 ms (0.1188 with 132 persistent
# CTAs) against Triton's 0.1086, 768 rows at 320 keys 0.4293 (0.3390) against 0.2714 (H200,
# 2026-11-28, `sweep_ragged --library --mosaic --programs 132,264 --cases
# paced_decode,decode_768`), so it takes tables of 8192 keys or more.
_H200 = dict(
    _H100, decode_backend="mosaic", decode_backend_min_keys=8192,
    # Decode steps over float8 pages (the Triton kernel's at every reach): 64-key tiles in three
    # stages, 200 rows at 400 keys 0.1312 ms against 0.1544 for the H100's entry, 768 rows at
    # 320 0.3232 against 0.3877 (H200, 2026-11-28, `sweep_ragged --fp8 --library --fp8-dots
    # f16,e4m3 --cases paced_decode,decode_768`). With V pages keys-last (`paged.py`) these
    # tiles run 200 rows at 400 keys in 0.0814 ms and 768 at 320 in 0.1945, against bf16
    # pages' 0.1111 / 0.2739 (`profiling/probe_fp8_v_layout.py`); a ragged call's decode rows
    # load their inputs before the block counts (`hoist_decode`): a paced step 0.0969 ms a
    # layer against 0.1014 (`sweep_ragged --fp8 --library --decode-options --pad-seqs 256`).
    # From 8192 keys of table, 128-key tiles in two stages: 8 rows at 8192 0.0611 against 0.0637
    # ms, 1 at 32768 0.0432 against 0.0473 (0.0622 / 0.0460 against 0.0646 / 0.0487 in the call
    # before); at 4096 keys they lose, 0.2557 against 0.1858 (`probe_fp8_v_layout.py`).
    decode_fp8=dict(block_rows=16, block_k=64, num_warps=4, num_stages=3, prefetch_pages=True,
                    fp8_dot="f16", hoist_decode=True,
                    long=dict(min_keys=8192, block_k=128, num_stages=2)))

TABLE = {
    "default": _DEFAULT,
    "H100": _H100,
    "H200": _H200,
}


# Quantized matmul tiles by weight shape (K, N) and rows: {(K, N): [(largest M, params), ...]},
# the first entry whose M covers the call wins; a shape or M without an entry takes the kernel's
# own rule (`w8a16_matmul.blocks_for`, `w4a16_matmul.params_for`). Entries come from
# `python -m benchmarks.sweep_quant --out DIR`, which prints them in this form; an entry whose
# tiles do not divide a call's shape is skipped. Llama-3-8B layers: qkv (4096, 6144),
# o (4096, 4096), gate_up (4096, 28672), down (14336, 4096).
# H100 80GB HBM3, JAX 0.11.2, 2026-11-26 (docs/benchmarks/quant.json; M=1 the 'acc' sums and
# the [N, K] rows; the float16 MMAs, 15-20% faster at M=4-16, are left out: activations past
# 65504 would overflow them). The fused q/k/v and gate/up shapes' two-row entries: 2026-11-27.
QUANT_MATMUL = {
    "w8a16": {  # FP8 (or INT8 QArray) weights stored [K, N], kernels/w8a16_matmul.py
        (4096, 4096): [
            (1, dict(block_m=1, block_n=128, block_k=64, split_k=16, num_warps=4, num_stages=2,
                     reduce='acc')),
            (4, dict(block_m=16, block_n=128, block_k=512, split_k=8, num_warps=4, num_stages=3,
                     swap=True)),
            (16, dict(block_m=16, block_n=128, block_k=512, split_k=8, num_warps=4, num_stages=4,
                     swap=True)),
        ],
        (4096, 6144): [
            (1, dict(block_m=1, block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=2,
                     reduce='acc')),
            (4, dict(block_m=16, block_n=128, block_k=256, split_k=4, num_warps=4, num_stages=4)),
            (16, dict(block_m=16, block_n=128, block_k=256, split_k=4, num_warps=4, num_stages=4)),
        ],
        (4096, 28672): [
            (1, dict(block_m=1, block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=2,
                     reduce='acc')),
            (4, dict(block_m=16, block_n=128, block_k=256, split_k=1, num_warps=4, num_stages=4)),
            (16, dict(block_m=16, block_n=128, block_k=256, split_k=1, num_warps=4, num_stages=4)),
        ],
        (14336, 4096): [
            (1, dict(block_m=1, block_n=64, block_k=128, split_k=16, num_warps=4, num_stages=2,
                     reduce='acc')),
            (4, dict(block_m=16, block_n=128, block_k=256, split_k=8, num_warps=4, num_stages=4)),
            (16, dict(block_m=16, block_n=128, block_k=256, split_k=8, num_warps=4, num_stages=4)),
        ],
    },
    "w8a16_nk": {  # FP8 weights stored [N, K] (quant.py k_last), the same kernel
        (4096, 1024): [
            (1, dict(block_m=1, block_n=16, block_k=256, split_k=16, num_warps=4, num_stages=2,
                     reduce='acc')),
            (2, dict(block_m=2, block_n=16, block_k=256, split_k=16, num_warps=4, num_stages=3,
                     reduce='sum')),
            (4, dict(block_m=4, block_n=32, block_k=256, split_k=16, num_warps=4, num_stages=3,
                     reduce='sum')),
            (16, dict(block_m=16, block_n=64, block_k=256, split_k=16, num_warps=4, num_stages=4,
                     swap=True)),
        ],
        (4096, 4096): [
            (1, dict(block_m=1, block_n=32, block_k=256, split_k=8, num_warps=4, num_stages=3,
                     reduce='sum')),
            (2, dict(block_m=2, block_n=32, block_k=128, split_k=8, num_warps=4, num_stages=3,
                     reduce='sum')),
            (4, dict(block_m=16, block_n=64, block_k=512, split_k=8, num_warps=4, num_stages=3,
                     swap=True)),
            (16, dict(block_m=16, block_n=64, block_k=256, split_k=8, num_warps=4, num_stages=4,
                     swap=True)),
        ],
        (4096, 6144): [
            (1, dict(block_m=1, block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=3,
                     reduce='sum')),
            (2, dict(block_m=2, block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=3,
                     reduce='sum')),
            (4, dict(block_m=16, block_n=128, block_k=128, split_k=8, num_warps=4, num_stages=4,
                     swap=True)),
            (16, dict(block_m=16, block_n=128, block_k=128, split_k=8, num_warps=4, num_stages=4,
                     swap=True)),
        ],
        (4096, 14336): [
            (1, dict(block_m=1, block_n=32, block_k=256, split_k=2, num_warps=4, num_stages=3,
                     reduce='sum')),
            (2, dict(block_m=2, block_n=32, block_k=128, split_k=2, num_warps=4, num_stages=3,
                     reduce='sum')),
            (4, dict(block_m=16, block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=4,
                     swap=True)),
            (16, dict(block_m=16, block_n=128, block_k=128, split_k=4, num_warps=4, num_stages=4,
                     swap=True)),
        ],
        (4096, 28672): [
            (1, dict(block_m=1, block_n=64, block_k=256, split_k=1, num_warps=8, num_stages=2,
                     reduce='acc')),
            (2, dict(block_m=2, block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=3,
                     reduce='sum')),
            (4, dict(block_m=16, block_n=128, block_k=128, split_k=2, num_warps=4, num_stages=4,
                     swap=True)),
            (16, dict(block_m=16, block_n=128, block_k=128, split_k=2, num_warps=4, num_stages=4,
                     swap=True)),
        ],
        (14336, 4096): [
            (1, dict(block_m=1, block_n=32, block_k=256, split_k=8, num_warps=4, num_stages=3,
                     reduce='sum')),
            (2, dict(block_m=2, block_n=32, block_k=128, split_k=8, num_warps=4, num_stages=3,
                     reduce='sum')),
            (4, dict(block_m=16, block_n=128, block_k=128, split_k=16, num_warps=4, num_stages=4,
                     swap=True)),
            (16, dict(block_m=16, block_n=128, block_k=128, split_k=16, num_warps=4, num_stages=4,
                     swap=True)),
        ],
    },
    "w4a16": {  # packed INT4 / INT8 weights, kernels/w4a16_matmul.py
        # the four fused shapes re-swept with the per-group forms beside the per-slab ones (H100,
        # 2026-11-26, `sweep_quant --kernels int4 --tiers 3 --ms 1,2,16,64,256`, then 32,128)
        (4096, 4096): [
            (1, dict(block_n=64, num_splits=16, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
            (2, dict(block_n=64, num_splits=16, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
            (16, dict(block_n=128, num_splits=8, num_warps=4, num_stages=3, unpack='convert',
                     reduce='dot_group', swap=False)),
            (32, dict(block_n=128, num_splits=8, num_warps=4, num_stages=3, unpack='convert',
                     reduce='dot_group', swap=False)),
            (64, dict(block_n=128, num_splits=8, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
            (128, dict(block_n=128, num_splits=4, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
            (256, dict(block_n=128, num_splits=2, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
        ],
        (4096, 6144): [
            (1, dict(block_n=32, num_splits=11, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
            (2, dict(block_n=64, num_splits=11, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
            (16, dict(block_n=128, num_splits=5, num_warps=4, num_stages=3, unpack='convert',
                     reduce='dot_group', swap=False)),
            (32, dict(block_n=128, num_splits=5, num_warps=4, num_stages=3, unpack='convert',
                     reduce='dot_group', swap=False)),
            (64, dict(block_n=128, num_splits=5, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
            (128, dict(block_n=128, num_splits=2, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
            (256, dict(block_n=128, num_splits=1, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
        ],
        (4096, 28672): [
            (1, dict(block_n=64, num_splits=2, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
            (2, dict(block_n=64, num_splits=2, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc_group', swap=False)),
            (16, dict(block_n=256, num_splits=2, num_warps=8, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
            (32, dict(block_n=128, num_splits=1, num_warps=4, num_stages=3, unpack='convert',
                     reduce='dot_group', swap=False)),
            (64, dict(block_n=128, num_splits=1, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
            (128, dict(block_n=128, num_splits=1, num_warps=8, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False, block_m=128)),
            (256, dict(block_n=128, num_splits=1, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=False)),
        ],
        (14336, 4096): [
            (1, dict(block_n=64, num_splits=8, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc_group', swap=False)),
            (2, dict(block_n=64, num_splits=16, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
            (16, dict(block_n=128, num_splits=8, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=True)),
            (32, dict(block_n=128, num_splits=8, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot_group', swap=True)),
            (128, dict(block_n=128, num_splits=4, num_warps=4, num_stages=3, unpack='magic',
                     reduce='dot', swap=False)),
        ],
        (4096, 1024): [
            (2, dict(block_n=32, num_splits=16, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
        ],
        (4096, 14336): [
            (2, dict(block_n=32, num_splits=4, num_warps=4, num_stages=3, unpack='magic',
                     reduce='acc', swap=False)),
        ],
    },
    "w8a8": {},  # FP8 weights x per-row FP8 activations, kernels/w8a8_matmul.py
}



def quant_params(kernel: str, m: int, k: int, n: int) -> dict | None:
    """The tuned tiles of `kernel` for an [m, k] x [k, n] call, or None."""
    for m_max, p in sorted(QUANT_MATMUL[kernel].get((k, n), ()), key=lambda e: e[0]):
        if m <= m_max:
            return dict(p)
    return None


def gpu_key() -> str:
    try:
        kind = jax.devices()[0].device_kind
    except Exception:  # no device yet: the default table
        return "default"
    return next((k for k in TABLE if k != "default" and k in kind), "default")


# Head dims past 128 (Gemma's 256): fewer keys a tile, so that shared memory stays within an
# SM's 227 KB. Gemma 3's dense forward asked 448 KB of it with the 128-dim tiles (H200,
# 2026-11-29); offline sm_90a compiles (profiling/triton_offline.py) of these at 256 take 160,
# 98 and 109 KB for flash, ragged and decode. Flash's tile is the fastest of seven at 256
# (benchmarks/sweep_flash_wide.py: 2.89 ms at 4k causal, 1.24x 64 x 32 in four warps; cuDNN
# 1.70 ms).
WIDE_HEADS = {"flash": dict(block_k=32), "ragged": dict(block_k=32), "decode": dict(block_k=64)}


def params(kernel: str, page_size: int | None = None, keys: int | None = None,
           head_dim: int | None = None) -> dict:
    """`kernel`'s entry for this GPU; with `page_size`, block_k as pages_per_block. An entry's
    `long` tiles replace its own for page tables of at least long["min_keys"] `keys`; heads
    past 128 take `WIDE_HEADS`' smaller tiles."""
    p = dict(TABLE[gpu_key()][kernel])
    long = p.pop("long", None)
    if long and keys is not None and keys >= long["min_keys"]:
        p |= {k: v for k, v in long.items() if k != "min_keys"}
    wide = WIDE_HEADS.get(kernel.split("_")[0]) if head_dim and head_dim > 128 else None
    if wide:
        p |= {k: min(v, p.get(k, v)) for k, v in wide.items()}
    if page_size is not None and "block_k" in p:
        p["pages_per_block"] = max(1, p.pop("block_k") // page_size)
    return p


def has(kernel: str) -> bool:
    """Whether this GPU's table has an entry for `kernel`."""
    return kernel in TABLE[gpu_key()]


def ragged_mosaic() -> dict | None:
    """The Mosaic GPU ragged kernel's tiles (16-bit pages) and the page-table reach from which
    it runs mixed steps on this GPU, or None (the Triton kernel always)."""
    entry = TABLE[gpu_key()].get("ragged_mosaic")
    return dict(entry) if entry else None


def decode_backend(keys: int | None = None) -> str:
    """The decode kernel that measured fastest on this GPU (16-bit pages; float8 pages take
    Triton) for a page table of `keys` keys: "triton" or "mosaic"."""
    entry = TABLE[gpu_key()]
    if keys is not None and keys < entry.get("decode_backend_min_keys", 0):
        return "triton"
    return entry.get("decode_backend", "triton")


def num_splits(work_items: int, max_tiles: int, mixed: bool = False) -> int:
    """Split-K factor for `work_items` (block, kv head) programs of at most `max_tiles` key
    tiles; `mixed` for a step with prefill chunks."""
    p = params("splits")
    target = p["target_programs_mixed" if mixed else "target_programs"]
    want = max(1, target // max(1, work_items))
    most = max_tiles // p["min_tiles_mixed"] if mixed else max_tiles
    return int(max(1, min(want, p["max_splits"], most)))


_invariant = contextvars.ContextVar("pallasite_batch_invariant", default=False)


@contextlib.contextmanager
def batch_invariant(on: bool | str = True):
    """Kernels traced inside take a row's sums in an order that does not depend on the batch:
    "attention" fixes the paged attention's key splits (see the module doc; free), True also
    sends plain matrix products to `invariant_matmul` and the attention to one tile shape for
    every step (each of their rows then comes out the same bits in any batch), False neither."""
    if on not in (False, True, "attention"):
        raise ValueError(f"batch_invariant {on!r} is not True, False or 'attention'")
    token = _invariant.set(on)
    try:
        yield
    finally:
        _invariant.reset(token)


def invariant() -> bool:
    """Attention splits at fixed key boundaries (either mode)."""
    return bool(_invariant.get())


def invariant_products() -> bool:
    """Every product and tile shape fixed too (`batch_invariant(True)`)."""
    return _invariant.get() is True
