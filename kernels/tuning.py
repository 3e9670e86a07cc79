"""Block sizes per GPU, chosen by `tools/bench_kernels.py --sweep` runs (see docs/kernels_notes.md).

Keys are matched as substrings of `jax.devices()[0].device_kind`; "default" serves any other GPU
and interpret mode. `target_programs` is how many (block, kv head, split) programs the split-K
heuristic aims for: a few per SM, so a batch-1 long-context decode still fills the GPU.
"""

from __future__ import annotations

import jax

_DEFAULT = {
    "flash": dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    "flash_d64": dict(block_q=128, block_k=64, num_warps=4, num_stages=3),
    "decode": dict(block_rows=16, pages_per_block=8, num_warps=4, num_stages=2),
    "ragged": dict(block_rows=64, pages_per_block=4, num_warps=4, num_stages=2),
    "splits": dict(target_programs=528, max_splits=64),
}

TABLE = {
    "default": _DEFAULT,
    "H100": _DEFAULT,
    "H200": _DEFAULT,
}


def gpu_key() -> str:
    try:
        kind = jax.devices()[0].device_kind
    except Exception:  # no device yet: the default table
        return "default"
    return next((k for k in TABLE if k != "default" and k in kind), "default")


def params(kernel: str) -> dict:
    return dict(TABLE[gpu_key()][kernel])


def num_splits(work_items: int, max_tiles: int) -> int:
    """Split-K factor for `work_items` (block, kv head) programs of at most `max_tiles` key tiles."""
    p = params("splits")
    want = max(1, p["target_programs"] // max(1, work_items))
    return int(max(1, min(want, p["max_splits"], max_tiles)))
