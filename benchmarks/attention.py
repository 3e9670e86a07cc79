"""The attention benchmarks' shared pieces: `pallasite.kernels` (installed or from this
checkout), random dense and paged inputs, the baselines ours is timed against, and the run's log.
Used by `bench_kernels`, its sweep, `sweep_decode` and the Nsight profilers.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .common import poison, rel_err, time_ms

ROOT = Path(__file__).resolve().parents[1]


def import_kernels():
    """`pallasite.kernels`, installed or straight from this checkout."""
    try:
        import pallasite.kernels as kernels
        return kernels
    except ImportError:
        pkg = types.ModuleType("pallasite")
        pkg.__path__ = [str(ROOT / "pallasite")]
        sys.modules["pallasite"] = pkg
        spec = importlib.util.spec_from_file_location(
            "pallasite.kernels", ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pallasite.kernels"] = mod
        spec.loader.exec_module(mod)
        return mod


K = import_kernels()
from pallasite.kernels import reference  # noqa: E402

LOG = []
# The Mosaic GPU decode kernel (kernels/paged_mgpu.py) is timed beside ours only once its smoke
# test passed in a child process.
MOSAIC_DECODE = dict(ok=False)
def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def try_time(name, fn, *args, **kw):
    try:
        return time_ms(fn, *args, **kw)
    except Exception as e:
        log(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return None


def time_mosaic_decode(q, kp, vp, ctx, table, check=True, **kw):
    """(ms, rel err against the reference) of kernels/paged_mgpu.py with the tiles in
    tuning.py (or `kw`)."""
    fn = lambda q, kp, vp, ctx, table: K.paged_attention(q, kp, vp, ctx, table, impl="pallas",
                                                         backend="mosaic", **kw)
    err = None
    if check:
        poison()
        err = rel_err(jax.jit(fn)(q, kp, vp, ctx, table),
                      jax.jit(reference.paged_attention_reference)(q, kp, vp, ctx, table))
    return try_time("mosaic decode", fn, q, kp, vp, ctx, table, device=True), err


# ---------------------------------------------------------------- inputs

def dense_inputs(key, B, T, S, H, KV, D, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    return (jax.random.normal(k1, (B, T, H, D), dtype), jax.random.normal(k2, (B, S, KV, D), dtype),
            jax.random.normal(k3, (B, S, KV, D), dtype))


def paged_inputs(rng, q_lens, ctx, H, KV, D, page_size, dtype, spare_pages=8):
    """Random pages, shuffled page tables. Returns q, k_pages, v_pages, query_start, ctx, table."""
    q_lens, ctx = np.asarray(q_lens), np.asarray(ctx)
    pps = max(1, int(math.ceil(ctx.max() / page_size)))
    S = len(ctx)
    P = S * pps + spare_pages
    table = rng.permutation(P)[: S * pps].reshape(S, pps).astype(np.int32)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (int(qs[-1]), H, D), dtype)
    kp = jax.random.normal(k2, (KV, P, page_size, D), dtype)
    vp = jax.random.normal(k3, (KV, P, page_size, D), dtype)
    return q, kp, vp, jnp.asarray(qs), jnp.asarray(ctx, jnp.int32), jnp.asarray(table)


def dense_from_pages(pages, table):
    return reference.gather_pages(pages, table)  # [S, L, KV, D]


# ---------------------------------------------------------------- baselines

def cudnn_attention(q, k, v, causal):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def jax_triton_mha(q, k, v, causal):
    from jax.experimental.pallas.ops.gpu import attention
    return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)


def jax_mgpu_attention(q, k, v, causal):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)
    return am.attention(q, k, v, cfg)


def jax_paged_reference(q, kp, vp, ctx, table):
    from jax.experimental.pallas.ops.gpu import paged_attention as pa
    pps = table.shape[1]
    k_splits = math.gcd(pps, 16)
    return pa.paged_attention(q, kp, vp, table, ctx, k_splits=k_splits,
                              pages_per_compute_block=min(8, pps // k_splits))


def dense_decode(q, k, v, ctx):
    """jnp decode over a dense cache: q [S, H, D], k/v [S, L, KV, D]."""
    S, H, D = q.shape
    KV = k.shape[2]
    qg = q.reshape(S, KV, H // KV, D)
    s = jnp.einsum("skgd,slkd->skgl", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
    s = jnp.where(jnp.arange(k.shape[1])[None, None, None] < ctx[:, None, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("skgl,slkd->skgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(S, H, D).astype(q.dtype)
