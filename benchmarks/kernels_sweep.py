"""`bench_kernels --sweep`: block sizes of the flash and decode kernels at the target cases. The
best ones replace this GPU's entries in the tuning table for the rest of the run (copy them into
kernels/tuning.py afterwards)."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from .attention import (K, MOSAIC_DECODE, cudnn_attention, dense_inputs, log, paged_inputs,
                        time_mosaic_decode, try_time)
from .common import rel_err
from pallasite.kernels import tuning  # after .attention: it finds it in a checkout

# Mosaic flash variants tried by --sweep: persistent (one CTA per SM looping over the query
# tiles) against one CTA per tile (num_ctas past the tile count), 128- and 64-key tiles, and
# software-pipelined consumers (overlap).
MOSAIC_VARIANTS = [dict(block_kv=128, num_stages=2), dict(block_kv=128, num_stages=2,
                   num_ctas=1 << 20), dict(block_kv=64, num_stages=3),
                   dict(block_kv=128, num_stages=2, overlap=True)]


def sweep(args):
    """Block sizes at the target cases. The best ones replace this GPU's entries in the tuning
    table for the rest of the run (copy them into kernels/tuning.py afterwards)."""
    H, KV, D, dtype = 32, 8, 128, jnp.bfloat16
    out, key = [], tuning.gpu_key()
    q, k, v = dense_inputs(jax.random.PRNGKey(5), 4, 4096, 4096, H, KV, D, dtype)
    best = None
    parts = args.sweep_parts.split(",")
    triton = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3),
              (64, 128, 4, 3), (128, 32, 4, 4)]
    for bq, bk, w, st in triton if "flash" in parts else []:
        kw = dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
        ms = try_time("sweep", lambda q, k, v: K.flash_attention(
            q, k, v, causal=True, impl="pallas", backend="triton", **kw), q, k, v, device=True)
        out.append(dict(kernel="flash_attention", backend="triton", seq=4096, causal=True,
                        ms=ms, **kw))
        log(f"sweep flash triton causal S=4096 {kw}: {ms}")
        if ms and (best is None or ms < best[0]):
            best = (ms, kw)
    if best:
        tuning.TABLE[key] = dict(tuning.TABLE[key], flash=best[1])
    best = None
    mosaic = ("flash" in parts or "mosaic" in parts) and \
        os.environ.get("PALLASITE_FLASH_BACKEND") != "triton"
    for variant in MOSAIC_VARIANTS if mosaic else []:
        kw = dict(block_q=64, **variant)
        for causal in (True, False):
            fn = lambda q, k, v: K.flash_attention(q, k, v, causal=causal, impl="pallas",
                                                   backend="mosaic", **kw)
            try:  # a variant is only a candidate if it agrees with cuDNN
                err = rel_err(jax.jit(fn)(q, k, v), jax.jit(
                    lambda q, k, v: cudnn_attention(q, k, v, causal))(q, k, v))
            except Exception as e:
                err = None
                log(f"  mosaic {kw}: FAILED {type(e).__name__}: {str(e)[:300]}")
            ms = try_time("sweep", fn, q, k, v, device=True) if err is not None else None
            out.append(dict(kernel="flash_attention", backend="mosaic", seq=4096, causal=causal,
                            ms=ms, rel_err_vs_cudnn=err, **kw))
            log(f"sweep flash mosaic causal={causal} S=4096 {kw}: {ms} ms, err {err}")
            if causal and ms and err < 2e-2 and (best is None or ms < best[0]):
                best = (ms, kw)
    if best:
        tuning.TABLE[key] = dict(tuning.TABLE[key], flash_mosaic=best[1])
    del q, k, v
    if "decode" not in parts:
        return out
    rng = np.random.default_rng(6)
    variants = [dict(block_k=16 * p, num_warps=w, num_stages=st, block_rows=r,
                     prefetch_pages=pf)
                for p, w, st, r, pf in [(8, 4, 2, 16, True), (8, 4, 2, 16, False),
                                        (4, 4, 2, 16, True), (4, 4, 3, 16, True),
                                        (4, 4, 4, 16, True), (8, 4, 2, 64, False),
                                        (4, 4, 3, 64, True), (8, 4, 2, 64, True),
                                        (4, 8, 3, 16, True), (8, 4, 3, 64, False)]]
    times = [[] for _ in variants]
    for B, C in [(64, 4096), (1, 32768)]:
        q, kp, vp, _, ctx, table = paged_inputs(rng, [1] * B, [C] * B, H, KV, D, 16, dtype)
        q = q.reshape(B, H, D)
        kv_bytes = 2 * B * C * KV * D * 2
        for i, kw in enumerate(variants):
            ppb = dict(kw, pages_per_block=kw["block_k"] // 16)
            del ppb["block_k"]
            ms = try_time("sweep", lambda *a: K.paged_attention(*a, impl="pallas", **ppb),
                          q, kp, vp, ctx, table, device=True)
            times[i].append(ms or float("inf"))
            out.append(dict(kernel="paged_attention", batch=B, context=C, ms=ms,
                            tbps=kv_bytes / ms / 1e9 if ms else None, **kw))
            log(f"sweep decode B={B} C={C} {kw}: {ms} ms "
                f"{kv_bytes / ms / 1e9 if ms else 0:.2f} TB/s")
        del q, kp, vp
    out += sweep_long_decode(rng, variants[int(np.argmin([math.prod(t) for t in times]))])
    score = [math.prod(t) for t in times]
    kw = variants[int(np.argmin(score))]
    ragged = dict(tuning.TABLE[key]["ragged"], **{n: kw[n] for n in (
        "block_k", "num_warps", "num_stages", "prefetch_pages")})
    tuning.TABLE[key] = dict(tuning.TABLE[key], decode=kw, ragged=ragged)
    log(f"chosen: {tuning.TABLE[key]}")
    return out


def sweep_long_decode(rng, base):
    """Batch 1, 32k context: split count, tile and pipeline depth (what fills 132 SMs)."""
    H, KV, D, B, C = 32, 8, 128, 1, 32768
    q, kp, vp, _, ctx, table = paged_inputs(rng, [1] * B, [C] * B, H, KV, D, 16, jnp.bfloat16)
    q = q.reshape(B, H, D)
    kv_bytes = 2 * B * C * KV * D * 2
    out = []
    shapes = [(64, 3, 64), (64, 4, 16), (64, 4, 64), (128, 3, 64), (128, 4, 16), (32, 4, 64)]
    for splits in (8, 16, 24, 32, 64):
        for bk, st, rows in shapes:
            kw = dict(base, block_k=bk, num_stages=st, num_splits=splits, block_rows=rows)
            ppb = dict(kw, pages_per_block=bk // 16)
            del ppb["block_k"]
            ms = try_time("sweep", lambda *a: K.paged_attention(*a, impl="pallas", **ppb),
                          q, kp, vp, ctx, table, device=True)
            out.append(dict(kernel="paged_attention", batch=B, context=C, ms=ms,
                            tbps=kv_bytes / ms / 1e9 if ms else None, **kw))
            log(f"sweep long decode {kw}: {ms} ms {kv_bytes / ms / 1e9 if ms else 0:.2f} TB/s")
    for splits in (8, 16, 32) if MOSAIC_DECODE["ok"] else []:
        for bk, st in ((64, 2), (64, 4), (128, 2)):  # (128, 3) overflows shared memory
            kw = dict(block_k=bk, num_stages=st, num_splits=splits)
            ms, err = time_mosaic_decode(q, kp, vp, ctx, table, check=splits == 16, **kw)
            out.append(dict(kernel="paged_attention", backend="mosaic", batch=B, context=C,
                            ms=ms, rel_err=err, tbps=kv_bytes / ms / 1e9 if ms else None, **kw))
            log(f"sweep long decode mosaic {kw}: {ms} ms err {err} "
                f"{kv_bytes / ms / 1e9 if ms else 0:.2f} TB/s")
    return out
