"""Attention kernels and the one place that picks an implementation.

`impl` is "reference" (plain jnp, any backend) or "pallas" (GPU kernels); None picks "pallas" on
GPU and "reference" elsewhere. `PALLASITE_ATTENTION_IMPL` overrides the automatic choice.
`interpret=True` runs the Pallas kernels in Pallas's interpreter (any backend; used by the tests).
Flash attention has two Pallas backends, Mosaic GPU on Hopper and Triton elsewhere
(`flash_backend`); so does decode, where the tuning table names the faster one per GPU
(`decode_backend`).
Extra keywords (block sizes, num_splits, ...) reach the Pallas kernels; defaults come from
`tuning.py`. Inside `portable_backends()` both take Triton unless a call or the environment
names a backend (the mesh hooks use it for programs over several GPUs).

Every attention entry takes `sliding_window`, `logit_softcap` and `sinks` (see `reference.py`:
a per-layer window is the model passing a different `sliding_window` per layer); the paged ones
also take `k_scale`/`v_scale` [KV] for quantized (float8) pages. A kernel that does not take an
option yet leaves the call to the reference (`_KERNEL_TAKES` says which take which).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp

from . import reference, tuning


def choose_impl(impl: str | None = None) -> str:
    impl = impl or os.environ.get("PALLASITE_ATTENTION_IMPL")
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl not in ("reference", "pallas"):
        raise ValueError(f"attention impl {impl!r} is not one of 'reference', 'pallas'")
    return impl


def _use_pallas(impl, interpret):
    return interpret or choose_impl(impl) == "pallas"


_PORTABLE = [False]  # inside portable_backends()


@contextlib.contextmanager
def portable_backends(on: bool = True):
    """While tracing inside it, flash and decode calls that name no backend take the Triton
    kernels. On two H200s a 31-layer tp=2 decode step with the Mosaic GPU decode kernel did
    not finish within 150 s, while with the Triton kernel it compiled in 11 s and ran (with 4
    layers both ran; docs/BENCHMARKS.md). Until that is understood, programs over several GPUs
    keep Mosaic GPU kernels out, the flash kernel too, which was never run on a mesh."""
    before, _PORTABLE[0] = _PORTABLE[0], on
    try:
        yield
    finally:
        _PORTABLE[0] = before


def _is_hopper() -> bool:
    try:
        return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
    except Exception:
        return False


# The options each Pallas kernel implements; a call with any other option set runs the reference.
_KERNEL_TAKES = {
    "flash": {"sliding_window", "logit_softcap", "sinks"},
    "flash_mosaic": set(),
    "paged": {"sliding_window", "logit_softcap", "sinks", "k_scale", "v_scale"},
    "paged_mosaic": set(),
}


def _options(**kw):
    """The options a call sets (those not None)."""
    return {k for k, v in kw.items() if v is not None}


def flash_backend(q, k, *, causal=True, segment_ids=None, backend=None) -> str:
    """"mosaic" (Hopper: wgmma, TMA, warp specialization; `flash_mgpu.py`) or "triton"
    (any GPU; `flash.py`). None picks Mosaic GPU on Hopper wherever it takes the call and
    Triton otherwise (and inside `portable_backends`); `PALLASITE_FLASH_BACKEND` overrides.
    Asking for "mosaic" where it cannot run raises with the reason."""
    from . import flash_mgpu
    backend = backend or os.environ.get("PALLASITE_FLASH_BACKEND")
    blocks = tuning.params("flash_mosaic")
    why = flash_mgpu.supported(q, k, causal=causal, segment_ids=segment_ids,
                               block_q=blocks["block_q"], block_kv=blocks["block_kv"])
    if backend is None:
        return "mosaic" if why is None and _is_hopper() and not _PORTABLE[0] else "triton"
    if backend not in ("mosaic", "triton"):
        raise ValueError(f"flash backend {backend!r} is not one of 'mosaic', 'triton'")
    if backend == "mosaic" and why:
        raise ValueError(f"the Mosaic GPU flash kernel cannot take this call: {why}")
    return backend


def flash_attention(q, k, v, *, causal=True, segment_ids=None, sm_scale=None,
                    sliding_window=None, logit_softcap=None, sinks=None, impl=None,
                    backend=None, interpret=False, **blocks):
    """Prefill / no-cache attention. q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D]."""
    opts = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    used = _options(**opts)
    if not _use_pallas(impl, interpret) or not used <= _KERNEL_TAKES["flash"]:
        return reference.attention_reference(q, k, v, causal=causal, segment_ids=segment_ids,
                                             sm_scale=sm_scale, **opts)
    if (used <= _KERNEL_TAKES["flash_mosaic"] and backend != "triton"
            and flash_backend(q, k, causal=causal, segment_ids=segment_ids,
                              backend=backend) == "mosaic"):
        from . import flash_mgpu
        kw = tuning.params("flash_mosaic") | blocks
        return flash_mgpu.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale,
                                          interpret=interpret,
                                          **{k: opts[k] for k in used}, **kw)
    from . import flash
    kw = tuning.params("flash" if q.shape[-1] > 64 else "flash_d64",
                       head_dim=q.shape[-1]) | blocks
    return flash.flash_attention(q, k, v, segment_ids, causal=causal, sm_scale=sm_scale,
                                 interpret=interpret, **{k: opts[k] for k in used}, **kw)


def _paged_params(name, k_pages):
    """The tuning entry of a paged call: float8 pages have their own tiles ("decode_fp8"
    everywhere, "ragged_fp8" where the GPU's table has it)."""
    fp8 = k_pages.dtype == jax.numpy.float8_e4m3fn and tuning.has(f"{name}_fp8")
    return f"{name}_fp8" if fp8 else name


def _key_tiles(page_table, page_size, pages_per_block, sliding_window, span=1):
    """Key tiles a query block of `span` tokens reads at most: the page table's, or with a
    sliding window the pages that window (and the block) can reach."""
    pages = page_table.shape[1]
    if sliding_window is not None:
        pages = min(pages, -(-(sliding_window + span - 1) // page_size) + 1)
    return -(-pages // pages_per_block)


def _mosaic_decode_params(q, k_pages, page_table, blocks):
    kw = tuning.params("decode_mosaic") | blocks
    if "num_splits" not in kw:
        tiles = -(-page_table.shape[1] * k_pages.shape[2] // kw["block_k"])
        kw["num_splits"] = tuning.num_splits(q.shape[0] * k_pages.shape[0], tiles)
    return kw


def decode_backend(q, k_pages, page_table, *, backend=None, **blocks) -> str:
    """"triton" (any GPU; `paged.py`) or "mosaic" (Hopper; `paged_mgpu.py`) for a decode call.
    None picks what measured fastest on this GPU (`tuning.decode_backend`: Mosaic GPU on the
    H200 for tables of 8192 keys or more, Triton on the H100, where the two are level; float8
    pages, V keys-last, on Triton everywhere) wherever it takes the call;
    `PALLASITE_DECODE_BACKEND` overrides. Tile keywords without a backend keep the Triton
    kernel they were written for. Asking for Mosaic GPU where it cannot run raises with the
    reason."""
    from . import paged_mgpu
    asked = backend or os.environ.get("PALLASITE_DECODE_BACKEND")
    if asked not in (None, "mosaic", "triton"):
        raise ValueError(f"decode backend {asked!r} is not one of 'mosaic', 'triton'")
    portable = blocks or not _is_hopper() or _PORTABLE[0]
    if k_pages.dtype == jax.numpy.float8_e4m3fn:  # V keys-last (reference.keys_last)
        if asked == "mosaic":
            raise ValueError("the Mosaic GPU decode kernel cannot take float8 pages, whose V "
                             "pages are keys-last ([KV, P, D, page_size])")
        return "triton"
    keys = page_table.shape[1] * k_pages.shape[2]
    backend = asked or ("triton" if portable else tuning.decode_backend(keys))
    if backend == "mosaic":
        why = paged_mgpu.supported(q, k_pages, **_mosaic_decode_params(q, k_pages, page_table,
                                                                         blocks))
        if why and asked:
            raise ValueError(f"the Mosaic GPU decode kernel cannot take this call: {why}")
        return "triton" if why else "mosaic"
    return backend


def paged_attention(q, k_pages, v_pages, context_lens, page_table, *, sm_scale=None,
                    sliding_window=None, logit_softcap=None, sinks=None, k_scale=None,
                    v_scale=None, impl=None, backend=None, interpret=False, **blocks):
    """Decode attention over paged K/V. q [S, H, D] -> [S, H, D]."""
    opts = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale)
    used = _options(**opts)
    if not _use_pallas(impl, interpret) or not used <= _KERNEL_TAKES["paged"]:
        return reference.paged_attention_reference(q, k_pages, v_pages, context_lens, page_table,
                                                   sm_scale=sm_scale, **opts)
    opts = {k: opts[k] for k in used}
    if (used <= _KERNEL_TAKES["paged_mosaic"] and decode_backend(
            q, k_pages, page_table, backend=backend, **blocks) == "mosaic"):
        from . import paged_mgpu
        return paged_mgpu.paged_attention(
            q, k_pages, v_pages, context_lens, page_table, sm_scale=sm_scale,
            interpret=interpret, **opts, **_mosaic_decode_params(q, k_pages, page_table, blocks))
    from . import paged
    kw = tuning.params(_paged_params("decode", k_pages), k_pages.shape[2],
                       page_table.shape[1] * k_pages.shape[2], q.shape[-1]) | blocks
    if "num_splits" not in kw:
        tiles = _key_tiles(page_table, k_pages.shape[2], kw["pages_per_block"], sliding_window)
        kw["num_splits"] = tuning.num_splits(q.shape[0] * k_pages.shape[0], tiles)
    return paged.paged_attention(q, k_pages, v_pages, context_lens, page_table,
                                 sm_scale=sm_scale, interpret=interpret, **opts, **kw)


# Page tables up to this many keys take the reference on CPU: XLA fuses its gather into the
# products, where the blockwise loop would hold a block per token; wider ones take the loop,
# whose memory and time follow the context in use, not the table (ragged_jnp.py).
DENSE_CPU_KEYS = 1024


def ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens, page_table, *,
                           sm_scale=None, sliding_window=None, logit_softcap=None, sinks=None,
                           k_scale=None, v_scale=None, impl=None, interpret=False, **blocks):
    """Mixed prefill + decode over paged K/V on one flat token axis. q [T, H, D] -> [T, H, D].
    Without Pallas (CPU) it runs blockwise in jnp over the context in use (`ragged_jnp.py`)."""
    opts = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale)
    used = _options(**opts)
    if not _use_pallas(impl, interpret):
        if page_table.shape[1] * k_pages.shape[2] <= DENSE_CPU_KEYS:  # narrow: one fused pass
            return reference.ragged_paged_attention_reference(
                q, k_pages, v_pages, query_start, context_lens, page_table, sm_scale=sm_scale,
                **opts)
        from . import ragged_jnp
        return ragged_jnp.ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens,
                                                 page_table, sm_scale=sm_scale, **opts)
    if not used <= _KERNEL_TAKES["paged"]:
        return reference.ragged_paged_attention_reference(
            q, k_pages, v_pages, query_start, context_lens, page_table, sm_scale=sm_scale,
            **opts)
    opts = {k: opts[k] for k in used}
    from . import paged
    T, S = q.shape[0], page_table.shape[0]
    # A step of (nearly) only decode tokens packs one token per block: small blocks waste less.
    # Batch-invariant calls keep one tile shape (and so one MMA) for every step.
    mixed = T > 2 * S or tuning.invariant_products()
    mosaic = None if blocks else _ragged_mosaic(q, k_pages, page_table, used, mixed)
    if mosaic is not None:
        from . import paged_mgpu
        return paged_mgpu.ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens,
                                                 page_table, sm_scale=sm_scale,
                                                 interpret=interpret, **opts, **mosaic)
    kw = tuning.params(_paged_params("ragged" if mixed else "decode", k_pages),
                       k_pages.shape[2], page_table.shape[1] * k_pages.shape[2],
                       q.shape[-1]) | blocks
    tiles = _key_tiles(page_table, k_pages.shape[2], kw["pages_per_block"], sliding_window,
                       T if mixed else 1)
    if "num_splits" not in kw and tuning.invariant():
        share = max(1, tuning.params("splits")["invariant_keys"]
                    // (kw["pages_per_block"] * k_pages.shape[2]))
        # A window's first tile moves back to a split boundary: up to one split more to read.
        kw["num_splits"] = -(-tiles // share) + (sliding_window is not None)
        kw["split_tiles"] = share
    elif "num_splits" not in kw:
        group = q.shape[1] // k_pages.shape[0]
        rows = paged.rows_per_block(kw["block_rows"], group, kw.get("fp8_dot", "q"),
                                    k_pages.dtype == jax.numpy.float8_e4m3fn)
        blocks_needed = max(-(-T * group // rows), S)
        kw["num_splits"] = tuning.num_splits(blocks_needed * k_pages.shape[0], tiles, mixed)
    return paged.ragged_paged_attention(q, k_pages, v_pages, query_start, context_lens,
                                        page_table, sm_scale=sm_scale, interpret=interpret,
                                        **opts, **kw)


def _ragged_mosaic(q, k_pages, page_table, used, mixed) -> dict | None:
    """The Mosaic GPU ragged kernel's tiles for a mixed step on a Hopper GPU whose tuning names
    them, where the page table reaches their `min_keys` (long contexts: with short ones the
    Triton kernel is faster) and the kernel takes the call; else None. Decode steps keep Triton
    (its decode is level with Triton's on the H100), and so do float8 pages (V keys-last).
    `PALLASITE_RAGGED_BACKEND=triton` keeps Triton always."""
    from . import paged_mgpu
    if k_pages.dtype == jax.numpy.float8_e4m3fn:  # V keys-last, which it does not read
        return None
    kw = tuning.ragged_mosaic()
    if (kw is None or not mixed or not used <= _KERNEL_TAKES["paged_mosaic"]
            or os.environ.get("PALLASITE_RAGGED_BACKEND", "").lower() == "triton"
            or tuning.invariant() or not _is_hopper() or _PORTABLE[0]):
        return None
    reach = page_table.shape[1] * k_pages.shape[2]  # keys the step's page table can hold
    if reach < kw.pop("min_keys"):
        return None
    return None if paged_mgpu.supported(q, k_pages, **kw) else kw


def mla_attention(q_lat, q_pe, latent_pages, rope_pages, query_start, context_lens, page_table,
                  *, sm_scale, impl=None, interpret=False, **blocks):
    """Multi-head latent attention in the absorbed form over latent pages, on one flat token
    axis (`mla_decode.py`): q_lat [T, H, L], q_pe [T, H, R] -> [T, H, L]. On GPU each token is
    a row of the Pallas decode kernel (its own context, its sequence's pages); elsewhere the
    jnp reference."""
    from . import mla_decode
    if not _use_pallas(impl, interpret):
        return mla_decode.ragged_mla_reference(q_lat, q_pe, latent_pages, rope_pages,
                                               query_start, context_lens, page_table,
                                               sm_scale=sm_scale)
    T, H, L = q_lat.shape
    lens, table = mla_decode.token_rows(query_start, context_lens, page_table, T)
    kw = mla_decode_blocks(H) | blocks
    if "num_splits" not in kw:
        # A split's partial ([H, L] float32, written and read back) must stay small against the
        # keys it reads (<= 1/8 of them: >= ~3600 keys a split at DeepSeek-V3's 128 heads).
        page_size = latent_pages.shape[2]
        keys = table.shape[1] * page_size
        key_bytes = (L + q_pe.shape[-1]) * latent_pages.dtype.itemsize
        by_bytes = max(1, keys * key_bytes // (8 * 8 * H * L))
        tiles = -(-keys // (kw.get("block_k") or page_size))
        kw["num_splits"] = min(by_bytes, tuning.num_splits(T * -(-H // kw["block_h"]), tiles))
    return mla_decode.mla_decode(q_lat, q_pe, latent_pages, rope_pages, lens, table,
                                 sm_scale=sm_scale, interpret=interpret, **kw)


def mla_decode_blocks(num_heads: int) -> dict:
    """The MLA decode kernel's tiles for `num_heads` query heads (H100, `benchmarks/bench_mla`,
    2026-11-25: 0.339 ms at 128 heads, B=64, 4k; within 1% of the best of 11 tiles): 64-head
    blocks over two warpgroups when there are that many, 64-token key tiles, 2 stages."""
    if num_heads >= 64:
        return dict(block_h=64, block_k=64, num_warps=8, num_stages=2, v_parts=1)
    return dict(block_h=max(16, pl_next_power_of_2(num_heads)), block_k=32, num_warps=4,
                num_stages=5, v_parts=1)


def pl_next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kv_write_kernel(impl, interpret) -> bool:
    """Whether K/V rows go into their pages by a Pallas kernel: asked for, or where
    `tuning.params("kv_write")` names it for the GPU."""
    return interpret or impl == "pallas" or (
        _use_pallas(impl, interpret) and tuning.params("kv_write")["impl"] == "pallas")


def write_kv(k_pages, v_pages, k, v, slots, *, k_scale=None, v_scale=None, impl=None,
             interpret=False):
    """Scatter this step's K/V [T, KV, D] into the pages at flat slots (-1 = padding), in place
    when the pages are donated. Both ways move only the new rows: XLA's scatter (the reference,
    a launch per array) or the Pallas kernel (`kv_write.py`, one launch for both), as
    `tuning.params("kv_write")` says for the GPU (an explicit impl="pallas" or interpret=True
    takes the kernel). With k_scale/v_scale [KV] the rows are stored as K / k_scale in the
    pages' dtype (float8: `reference.quantize_kv`)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("write_kv takes both k_scale and v_scale or neither")
    if not _kv_write_kernel(impl, interpret):
        return reference.write_kv_reference(k_pages, v_pages, k, v, slots, k_scale=k_scale,
                                            v_scale=v_scale)
    from . import kv_write
    return kv_write.write_kv(k_pages, v_pages, k, v, slots, k_scale=k_scale, v_scale=v_scale,
                             interpret=interpret)


def rope_write_kv(y, k_pages, v_pages, slots, cos, sin, *, bias=None, norm=None, eps=1e-6,
                  plus_one=False, k_scale=None, v_scale=None, impl=None, interpret=False,
                  **blocks):
    """A fused q/k/v projection's epilogue: y [T, KV, G + 2, D] (per kv head its G queries, key
    and value), with `bias` (bq [KV * G, D], bk [KV, D], bv [KV, D]) added first and `norm`
    (q's and k's RMSNorm weights [D]; `eps`, `plus_one`) over each query and key head, RoPE by
    cos/sin [T, R / 2] float32 on the leading R columns -> (q [T, KV * G, D], the pages with
    the keys and the values at slots). Where `write_kv` takes its kernel, one launch
    (`rope_kv.py`); else the jnp reference. PALLASITE_ROPE_KV=0 keeps XLA's passes before the
    KV write kernel (what the one launch replaced, for timing it)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("rope_write_kv takes both k_scale and v_scale or neither")
    kw = dict(bias=bias, norm=norm, eps=eps, plus_one=plus_one)
    if not _kv_write_kernel(impl, interpret):
        return reference.rope_write_kv_reference(y, k_pages, v_pages, slots, cos, sin, **kw,
                                                 k_scale=k_scale, v_scale=v_scale)
    if os.environ.get("PALLASITE_ROPE_KV", "1") == "0":
        q, k, v = reference.rope_projection(y, cos, sin, **kw)
        k, v = (reference.pad_last(x, k_pages.shape[-1]) for x in (k, v))
        return q, *write_kv(k_pages, v_pages, k, v, slots, k_scale=k_scale, v_scale=v_scale,
                            impl="pallas", interpret=interpret)
    from . import rope_kv
    return rope_kv.rope_write_kv(y, k_pages, v_pages, slots, cos, sin, **kw, k_scale=k_scale,
                                 v_scale=v_scale, interpret=interpret,
                                 **(tuning.params("rope_kv") | blocks))


GROUPED_MIN_ROWS_PER_EXPERT = 16  # below this many rows per expert, XLA's ragged_dot is used


def grouped_mlp(x, group_sizes, w_gate, w_up, w_down, *, glu=None, biases=None, impl=None,
                interpret=False, **blocks):
    """Mixture-of-experts SwiGLU: x [M, D] sorted by expert, `group_sizes` [E] rows per expert,
    w_gate/w_up [E, D, F], w_down [E, F, D] -> [M, D]. The Pallas path lays the rows out once
    in expert-aligned blocks and runs its three grouped products there (`grouped_matmul.py`).
    `glu(gate, up)` replaces silu(gate) * up; `biases` (b_gate [E, F], b_up [E, F], b_down
    [E, D]) are added per expert (GPT-OSS). Packed integer experts (`grouped_int.IntExperts`,
    any of the three) take `grouped_int.py`'s kernel."""
    from . import grouped_int as gi
    if any(isinstance(w, gi.IntExperts) for w in (w_gate, w_up, w_down)):
        return _grouped_int_mlp(x, group_sizes, (w_gate, w_up, w_down), glu, biases, impl,
                                interpret, blocks)
    if glu is not None or biases is not None:  # the Pallas path runs only SwiGLU without biases
        return reference.grouped_mlp_reference(x, group_sizes, w_gate, w_up, w_down,
                                               glu=glu or reference.silu_glu, biases=biases)
    tile = 128
    quantized = isinstance(w_gate, tuple)  # (values [E, K, N], float32 scales [E, G, N])
    # Measured on the H100 (docs/BENCHMARKS.md, MoE experts): with fewer than ~16 rows per
    # expert (decode) XLA's ragged_dot is as fast or faster; from there on this path wins.
    # An explicit impl="pallas" (benchmarks) or interpret=True (tests) skips that choice.
    shape = w_gate[0].shape if quantized else w_gate.shape
    few_rows = x.shape[0] < GROUPED_MIN_ROWS_PER_EXPERT * shape[0] and impl is None \
        and not interpret
    grouped_scales = quantized and w_gate[1].shape[1] > 1  # the kernel takes per-channel only
    if (not _use_pallas(impl, interpret) or few_rows or shape[-1] % tile
            or x.shape[-1] % tile or grouped_scales):
        if quantized:
            from .quant_reference import dequantize_matrix
            x, ws = after(x, (w_gate, w_up, w_down))
            w_gate, w_up, w_down = (jax.vmap(dequantize_matrix)(*w).astype(x.dtype)
                                    for w in ws)
        return reference.grouped_mlp_reference(x, group_sizes, w_gate, w_up, w_down)
    from . import grouped_matmul as gm
    block_m = gm.block_m_for(x.shape[0], shape[0])
    x_pad, dest, block_group = gm.pad_groups(x, group_sizes, block_m)

    def mm(a, w):
        w, scale = w if quantized else (w, None)
        return gm.grouped_matmul_padded(a, w, block_group, scale, interpret=interpret, **blocks)
    h = jax.nn.silu(mm(x_pad, w_gate)) * mm(x_pad, w_up)
    return gm.unpad_groups(mm(h, w_down), dest)


def _grouped_int_mlp(x, group_sizes, ws, glu, biases, impl, interpret, blocks):
    """Experts with packed INT4/INT8 weights: on GPU always the grouped kernel (it reads only
    the packed weights of experts that have rows; dequantizing every expert for XLA's
    ragged_dot would read and write all of them each step), where its tiles fit; the
    dequantized jnp reference elsewhere."""
    from . import grouped_int as gi
    if interpret or (_use_pallas(impl, interpret) and gi.supported(ws)):
        return gi.grouped_int_mlp(x, group_sizes, *ws, glu=glu, biases=biases,
                                  interpret=interpret, **blocks)
    if _use_pallas(impl, interpret):  # tiles the kernel does not take: dequantized in the graph
        x, ws = after(x, ws)
    return gi.grouped_int_mlp_reference(x, group_sizes, *ws, glu=glu, biases=biases)


# -- quantized matrix products ---------------------------------------------------------------------
# Up to this many rows (tokens) a call takes W8A16 (weights read once, in their stored bytes);
# above it FP8 (INT8) weights take W8A8 on the 8-bit tensor cores. cuBLASLt's W8A8 reads the
# weights about as fast: an 8B layer's products 1.49-1.54x bf16 at 4-16 rows, where the W8A16
# kernel runs 1.16-1.18x; 1.52x at two rows against 1.31x, 1.57x at one against 1.76x (H100,
# `benchmarks/w8a8_compile.py`). Two rows stay W8A16: those steps keep XLA's Triton GEMMs
# (`serving/settings.py` compiler_options), whose FP8 autotuning takes minutes.
W8A16_MAX_ROWS = 2
_SAID = set()


def _say_once(message: str):
    if message not in _SAID:
        _SAID.add(message)
        import logging
        logging.getLogger("pallasite").warning(message)


def has_fp8_tensor_cores() -> bool:
    """sm_89 (Ada) and sm_90+ (Hopper and later) GPUs."""
    try:
        major, minor = (int(p) for p in str(jax.devices()[0].compute_capability).split(".")[:2])
    except Exception:
        return False
    return (major, minor) >= (8, 9)


def quant_mode(x, q, zero=None, mode=None) -> str:
    """"w8a16" or "w8a8" for a call: by rows, on GPUs with FP8 tensor cores for FP8 weights
    (INT8 tensor cores for INT8 ones), for weights without zeros. `PALLASITE_QUANT_MATMUL` or
    `mode` names one (W8A8 only where it is right)."""
    mode = mode or os.environ.get("PALLASITE_QUANT_MATMUL")
    if mode not in (None, "w8a16", "w8a8"):
        raise ValueError(f"quantized matmul mode {mode!r} is not one of 'w8a16', 'w8a8'")
    int8 = q.dtype == jax.numpy.int8
    if q.dtype != jax.numpy.float8_e4m3fn and not int8 or zero is not None:
        if mode == "w8a8":
            raise ValueError(f"W8A8 takes float8_e4m3fn or int8 weights without zeros, not "
                             f"{q.dtype}{' with zeros' if zero is not None else ''}")
        return "w8a16"
    if mode is not None:
        return mode
    if x.shape[0] <= W8A16_MAX_ROWS:
        return "w8a16"
    if jax.default_backend() != "gpu":
        return "w8a16"
    if not int8 and not has_fp8_tensor_cores():
        _say_once("this GPU has no FP8 tensor cores (sm_89 / sm_90+): FP8 weights run as "
                  "W8A16 (bf16 activations) at every batch size")
        return "w8a16"
    return "w8a8"


W8A8_IMPLS = ("xla", "pallas", "mosaic")


def w8a8_impl(x, q, scale, impl=None, *, layout: str = "kn", interpret=False, **blocks) -> str:
    """"xla" (cuBLASLt's FP8 GEMM through XLA's dot, `quant_reference.w8a8_matmul`), "pallas"
    (the Triton kernel, `w8a8_matmul.py`) or "mosaic" (the Mosaic GPU kernel, Hopper, weights
    stored [N, K] only, `w8a8_mgpu.py`) for a W8A8 call. None: "xla" (the default until the GPU
    comparison, `benchmarks/bench_w8a8.py`, says otherwise); `PALLASITE_W8A8_IMPL` overrides.
    A call the chosen kernel cannot take runs on XLA (said once, with the reason)."""
    impl = impl or os.environ.get("PALLASITE_W8A8_IMPL") or "xla"
    if impl not in W8A8_IMPLS:
        raise ValueError(f"W8A8 impl {impl!r} is not one of {W8A8_IMPLS}")
    if impl == "xla":
        return impl
    from . import w8a8_matmul as wt, w8a8_mgpu as wmg
    k, n = (q.shape[1], q.shape[0]) if layout == "nk" else q.shape
    if jax.default_backend() != "gpu" and not interpret:
        why = f"{jax.default_backend()} backend, not interpret mode"
    elif impl == "mosaic":
        why = ("weights stored [K, N] (it reads [N, K])" if layout != "nk" else
               "not a Hopper GPU" if jax.default_backend() == "gpu" and not _is_hopper() else
               wmg.supported(x.shape[0], k, n, scale.shape[0], **blocks))
    else:
        why = wt.supported(x.shape[0], k, n, scale.shape[0],
                           **(wt.blocks_for(x.shape[0], k, n) | blocks))
    if why:  # a call's shape or this backend
        _say_once(f"the {impl} W8A8 kernel cannot take a {k}x{n} weight with "
                  f"{scale.shape[0]} scale rows ({why}): XLA's FP8 dot runs it")
        return "xla"
    return impl


def quant_matmul(x, q, scale, zero=None, *, mode=None, impl=None, w8a8=None,
                 layout: str = "kn", unscaled=False, interpret=False, **blocks):
    """x [M, K] times quantized weights q [K, N] with float32 scale [G, N] (and zero) ->
    [M, N] in x's dtype. W8A16 through the Pallas kernel (`w8a16_matmul.py`) on GPU, its jnp
    reference elsewhere; W8A8 through XLA's FP8 dot (`quant_reference.w8a8_matmul`) or the
    Pallas kernels (`w8a8_matmul.py`, `w8a8_mgpu.py`), as `w8a8` (or `PALLASITE_W8A8_IMPL`)
    picks (`w8a8_impl`); INT8 weights through XLA's INT8 dot. `layout="nk"`: q is stored
    transposed, [N, K] (how FP8 weights are stored: `model/quant.py` k_last). `unscaled`: a
    W8A8 call on XLA's dot returns its product before the scales (`Product`), for the norm
    after it to scale; other calls return the product itself."""
    from . import quant_reference as qr
    eight = dict(layout=layout, unscaled=unscaled)
    if isinstance(x, qr.Rows8):  # rows quantized already (`norm_quantize`): XLA's 8-bit dot
        if (q.dtype != x.q.dtype or scale.shape[0] != 1
                or quant_mode(x, q, zero, mode) != "w8a8"):
            raise ValueError(f"rows quantized to {x.q.dtype} reach a product that does not "
                             f"take them ({q.dtype} weights, {x.shape[0]} rows)")
        int8 = q.dtype == jax.numpy.int8
        return (qr.w8a8_int8_matmul if int8 else qr.w8a8_matmul)(x, q, scale, **eight)
    if quant_mode(x, q, zero, mode) == "w8a8":
        if q.dtype == jax.numpy.int8:  # SmoothQuant W8A8: XLA's INT8 GEMM (cuBLASLt)
            return qr.w8a8_int8_matmul(x, q, scale, **eight)
        impl = w8a8_impl(x, q, scale, w8a8, layout=layout, interpret=interpret, **blocks)
        if impl == "pallas":
            from . import w8a8_matmul as wm
            return wm.w8a8_matmul(x, q, scale, layout=layout, interpret=interpret, **blocks)
        if impl == "mosaic":
            from . import w8a8_mgpu
            return w8a8_mgpu.w8a8_matmul(x, q, scale, interpret=interpret, **blocks)
        return qr.w8a8_matmul(x, q, scale, **eight)
    if layout not in ("kn", "nk"):
        raise ValueError(f"quantized matmul layout {layout!r} is not 'kn' or 'nk'")
    # Triton has no float8 type before sm_89: there the weights are dequantized by XLA.
    old_gpu = q.dtype == jax.numpy.float8_e4m3fn and not interpret and not has_fp8_tensor_cores()
    if not _use_pallas(impl, interpret) or old_gpu:
        if old_gpu:
            x, q = after(x, q)
        return qr.w8a16_reference(x, q.T if layout == "nk" else q, scale, zero)
    from . import w8a16_matmul as qm
    k, n = (q.shape[1], q.shape[0]) if layout == "nk" else q.shape
    kw = qm.blocks_for(x.shape[0], k, n, scale.shape[0], layout=layout) | blocks
    return qm.w8a16_matmul(x, q, scale, zero, layout=layout, interpret=interpret, **kw)


def w8a8_rows(x, q, scale, zero=None, *, mode=None, layout: str = "kn"):
    """The 8-bit dtype (float8_e4m3fn or int8) a call of `quant_matmul` quantizes x's rows to
    before XLA's 8-bit dot, or None where it runs otherwise (W8A16, a Pallas W8A8 kernel, scale
    groups along K). A caller holding x before its norm can then make those rows in the norm's
    own pass (`norm_quantize`); `PALLASITE_W8A8_NORM=0` says None (for timing)."""
    if os.environ.get("PALLASITE_W8A8_NORM", "1") == "0":
        return None
    if scale.shape[0] != 1 or quant_mode(x, q, zero, mode) != "w8a8":
        return None
    if q.dtype != jnp.int8 and w8a8_impl(x, q, scale, layout=layout) != "xla":
        return None
    return q.dtype


def norm_quantize(x, weight, residual=None, *, eps, plus_one=False, out, impl=None,
                  interpret=False):
    """RMSNorm(x + residual) times `weight`, quantized per row to `out` for the W8A8 products
    that follow: (`Rows8`, the sum x + residual or None). The residual may be a W8A8 product
    before its scales (`Product`), scaled in the same pass. One Pallas pass on GPU
    (`norm_quant.py`), where D falls in pieces of 128 or more; XLA's otherwise."""
    from . import norm_quant, quant_reference as qr
    fn = norm_quant.norm_quantize_reference
    if _use_pallas(impl, interpret) and norm_quant.piece(x.shape[-1]) >= 128:
        fn = functools.partial(norm_quant.norm_quantize, interpret=interpret)
    scales = None
    if isinstance(residual, qr.Product):
        if residual.dtype != x.dtype:
            raise ValueError(f"a {residual.dtype} product reaches a {x.dtype} stream")
        cols = jnp.broadcast_to(residual.col_scale.reshape(-1), x.shape[-1:])
        residual, scales = residual.p, (residual.row_scale, cols)
    xq, xs, total = fn(x, weight, residual, scales, eps=eps, plus_one=plus_one, out=out)
    return (xq if out is None else qr.Rows8(xq, xs, x.dtype)), total


def one_pass_norms() -> bool:
    """Whether the paged step's norms take `add_norm` (`PALLASITE_ADD_NORM=0`: XLA's passes,
    for timing)."""
    return os.environ.get("PALLASITE_ADD_NORM", "1") != "0"


def add_norm(x, weight, residual=None, *, eps, plus_one=False, impl=None, interpret=False):
    """(RMSNorm(x + residual) times `weight`, the sum x + residual or None), both in x's dtype,
    in one pass: `norm_quantize` without the quantization. XLA makes the add, the sum of
    squares and the scaling three kernels; at one row each is a launch (`profile_step`)."""
    return norm_quantize(x, weight, residual, eps=eps, plus_one=plus_one, out=None, impl=impl,
                         interpret=interpret)


def w8a8_glu(x, gate_up, down, *, mode=None, impl=None, unscaled=False, interpret=False):
    """silu(gate) * up times the down weight, both products W8A8: x [M, K] (or its rows
    quantized, `Rows8`) -> [M, N] in x's dtype, where gate_up and down are (q, scale, zero,
    layout) as `quant_matmul` takes them, gate_up's N being [gate | up] (2F). Between the two
    8-bit GEMMs one kernel scales the raw gate/up product, applies SwiGLU and quantizes the
    rows for the down GEMM (`glu_quant.py`), where XLA makes three passes of it. None where it
    does not apply: not 8-bit weights with a scale per output channel, F not a multiple of 128
    (the kernel's pieces), a call `quant_matmul` would not run as W8A8 on XLA's dot (the caller
    then takes two `quant_matmul` calls), or `PALLASITE_W8A8_GLU=0` (for timing the two
    calls). `unscaled`: the down product before its scales (`Product`)."""
    from . import glu_quant, quant_reference as qr
    if os.environ.get("PALLASITE_W8A8_GLU", "1") == "0":
        return None
    (qg, sg, zg, lg), (qd, sd, zd, ld) = gate_up, down
    eight = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))
    if (qg.dtype != qd.dtype or qg.dtype not in eight or zg is not None or zd is not None
            or sg.shape[0] != 1 or sd.shape[0] != 1 or sg.shape[1] % 256  # F in 128s
            or quant_mode(x, qg, mode=mode) != "w8a8"):
        return None
    int8 = qg.dtype == jnp.int8
    if not int8 and w8a8_impl(x, qg, sg, layout=lg, interpret=interpret) != "xla":
        return None
    if isinstance(x, qr.Rows8):
        if x.q.dtype != qg.dtype:
            raise ValueError(f"rows quantized to {x.q.dtype} reach {qg.dtype} weights")
        xq, xs = x.q, x.scale
    else:
        xq, xs = qr.quantize_rows_as(x, qg.dtype)
    p = qr.dot8(xq, qg, layout=lg, out=jnp.int32 if int8 else x.dtype,
                precision=None if int8 else jax.lax.Precision.HIGHEST)
    f = p.shape[1] // 2
    glu = (functools.partial(glu_quant.glu_quantize, interpret=interpret)
           if _use_pallas(impl, interpret) else glu_quant.glu_quantize_reference)
    hq, hs = glu(p.reshape(-1, 2, f), xs, sg.reshape(2, f), out=qg.dtype)
    rows = qr.Rows8(hq, hs, x.dtype)
    int8_or_fp8 = qr.w8a8_int8_matmul if int8 else qr.w8a8_matmul
    return int8_or_fp8(rows, qd, sd, layout=ld, unscaled=unscaled)


def matmul(x, w, *, layout: str = "kn", out_dtype=None, impl=None, interpret=False, **blocks):
    """x [..., K] times a plain weight w [K, N] (or [N, K], layout "nk") -> [..., N] in
    `out_dtype` (x's by default), accumulated in float32. XLA's dot, except inside
    `tuning.batch_invariant(True)` with the Pallas kernels, where it is `invariant_matmul`:
    each row's bits then do not depend on how many rows the call has (K in whole 64-tiles)."""
    from . import invariant_matmul as im
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    n = w.shape[0] if layout == "nk" else w.shape[1]
    if not (tuning.invariant_products() and _use_pallas(impl, interpret)
            and im.takes(x.shape[-1], n)):
        return jnp.matmul(x, w.T if layout == "nk" else w, preferred_element_type=out_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    kw = im.blocks_for(x2.shape[0], x2.shape[1], n) | blocks
    y = im.invariant_matmul(x2, w, layout=layout, out_dtype=out_dtype, interpret=interpret, **kw)
    return y.reshape(*x.shape[:-1], n)


# -- integer weight-only matrix products (W4A16, W8A16) ------------------------------------------
INT_MATMUL_MAX_ROWS = 256  # above this many rows a call dequantizes once and takes XLA's dot
# INT4 in the Hopper layout: its kernel, two warpgroups a CTA, is 1.08-1.33x that path at
# 384-512 rows on 8B layers (qkv level) and slower at 768 (H100, benchmarks/w4a16_issue.py)
INT4_HOPPER_MAX_ROWS = 512
# w4a16_matmul.pack's words [K/per, N]; w4a16_mgpu.pack_t's [N, K/per]; w4a16_mgpu.pack_i4's
# int4 [N, K] (symmetric INT4 in groups of whole 128-row tiles)
INT_LAYOUTS = ("kn", "nk16", "nk_i4")
# Rows up to which the Hopper layout's product runs on the CUDA cores (`w4a16_gemv`): at one row
# it is 1.14-1.32x the MMA kernel on 8B layers; at two about level, from four slower (H100).
# The forms run and timed on the GPU against the MMA kernel at one row (all faster): other forms
# (tested in interpret mode) stay on the MMA kernel until they are.
INT_GEMV_MAX_ROWS = 1
INT_GEMV_FORMS = {(4, 128, False), (4, 128, True), (8, 128, False)}  # (bits, group, zero points)


def int_layout() -> str:
    """The packed layout the integer kernels read fastest here: the Hopper kernel's transposed
    words (`w4a16_mgpu`, faster from 16 rows up, level at one) on an sm_90 GPU running the
    Pallas kernels, unless PALLASITE_INT_KERNEL=triton; the Triton kernel's words elsewhere.
    (Where the Hopper kernel takes "nk16", symmetric INT4 moves on to "nk_i4": `quant_int`.)"""
    if (os.environ.get("PALLASITE_INT_KERNEL", "").lower() != "triton" and _is_hopper()
            and choose_impl() == "pallas" and not _PORTABLE[0]):
        return "nk16"
    return "kn"


def int_matmul(x, words, scale, zero=None, perm=None, *, bits: int, group_size: int,
               layout: str = "kn", impl=None, interpret=False, **blocks):
    """x [M, K] times packed INT4/INT8 weights (`w4a16_matmul.pack`, or with `layout` "nk16"
    `w4a16_mgpu.pack_t`, with "nk_i4" `w4a16_mgpu.pack_i4`) -> [M, N] in x's dtype: the Pallas
    kernel on GPU up to INT_MATMUL_MAX_ROWS rows (INT4_HOPPER_MAX_ROWS for INT4 in the Hopper
    layouts), the dequantized weight through XLA's dot above (prefill is compute-bound) and on
    other backends."""
    from . import w4a16_gemv as gv
    from . import w4a16_matmul as im
    from . import w4a16_mgpu as mg
    kw = dict(bits=bits, group_size=group_size)
    k, hopper, i4 = x.shape[-1], layout in ("nk16", "nk_i4"), layout == "nk_i4"
    rows = INT4_HOPPER_MAX_ROWS if hopper and bits == 4 else INT_MATMUL_MAX_ROWS
    if interpret or (_use_pallas(impl, interpret) and x.shape[0] <= rows):
        if i4:  # int4 tiles: one row included (level with `w4a16_gemv` on the words there)
            return mg.int_matmul(x, words, scale, None, perm, interpret=interpret, **kw, **(
                mg.i4_blocks(x.shape[0], words.shape[0], words.shape[1] // mg.tile_rows(4),
                             group_size=group_size) | blocks))
        if not hopper:
            return im.int_matmul(x, words, scale, zero, perm, interpret=interpret, **kw,
                                 **blocks)
        if not blocks and _int_gemv_takes(x.shape[0], words, zero is not None, **kw):
            return gv.int_matmul(x, words, scale, zero, perm, interpret=interpret, **kw)
        tiles = words.shape[1] // mg.SLAB  # a K tile is SLAB words a column
        return mg.int_matmul(x, words, scale, zero, perm, interpret=interpret, **kw,
                             **(mg.blocks_for(x.shape[0], words.shape[0], tiles, **kw,
                                              zero_points=zero is not None) | blocks))
    # The weight dequantized as it is stored ([N, K] for the Hopper layout: XLA's dot takes
    # either side transposed, while transposing the weight would cost a pass over it).
    dims = (((1,), (1 if hopper else 0,)), ((), ()))
    if i4:
        dequantize = lambda w: mg.dequantize_i4(w, scale, group_size=group_size, k=k)
    elif hopper:
        dequantize = lambda w: mg.dequantize_t(w, scale, zero, k=k, **kw)
    else:
        dequantize = lambda w: im.dequantize(w, scale, zero, k=k, **kw)
    if not _use_pallas(impl, interpret):
        x = x if perm is None else x[..., perm]
        return jax.lax.dot_general(x.astype(jnp.float32), dequantize(words), dims,
                                   precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
    x, words = after(x, words)
    return jax.lax.dot_general(x if perm is None else x[..., perm],
                               dequantize(words).astype(x.dtype), dims)


def _int_gemv_takes(m: int, words_t, zero_points: bool, *, bits: int, group_size: int) -> bool:
    """Whether `w4a16_gemv` runs this Hopper-layout call (`PALLASITE_INT_GEMV=0`: never)."""
    from . import w4a16_gemv as gv
    return (m <= INT_GEMV_MAX_ROWS and (bits, group_size, zero_points) in INT_GEMV_FORMS
            and os.environ.get("PALLASITE_INT_GEMV", "1") != "0"
            and gv.supported(m, words_t.shape[0], bits=bits, group_size=group_size,
                             k_pad=words_t.shape[1] * 32 // bits))


def after(x, w):
    """w, as an operand XLA cannot read before x exists. A weight dequantized in the graph
    depends on nothing else, so XLA may build every layer's at the start of a step and keep
    them all: at 8192 tokens on an 8B model that was a 10 GB buffer, which ran the device out
    of memory. Tied to the layer's input, each is built when its layer runs."""
    return jax.lax.optimization_barrier((x, w))
