"""Which half of the Mosaic GPU decode kernel holds float8 pages back: its producer (TMA into
the float8 staging ring, then the conversion to float16) or its consumer (two warpgroup MMAs
and the online softmax over 64 rows per tile, G of them real).

    python -m profiling.probe_fp8_decode --out DIR     # H100, under a minute

Batch 64 at context 4k (32 query / 8 kv heads of 128, pages of 16) at the library's float8
tiles, four ways: the kernel as it is; the producer passing each tile on unconverted (the
consumer computes on whatever the float16 ring holds); the consumer only taking and releasing
the tiles (no MMA, no softmax; it writes q back); both stripped, which leaves the pipeline
itself. Outputs of the stripped kernels are wrong by design: only the full one is checked
against the reference. Device medians (`benchmarks/common.py`), against a copy of the same
bytes. Writes DIR/probe_fp8_decode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import common
from benchmarks.sweep_fp8kv import inputs
from pallasite import kernels as K
from pallasite.kernels import paged_mgpu, reference


def _take_and_release(q_ref, out_refs, q_smem, o_smem, q_full, *, b, kv, k_full, v_full, k_free,
                      v_free, lo, hi, num_stages, **_):
    """The consumer's waits and releases, without the products and the softmax."""
    plgpu.copy_gmem_to_smem(q_ref.at[b, kv], q_smem, q_full)
    plgpu.barrier_wait(q_full)

    @pl.loop(lo, hi)
    def _(j):
        slot = lax.rem(j - lo, num_stages)
        plgpu.barrier_wait(k_full.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_full.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])

    plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(0, out_refs[0].shape[-2])], out_refs[0].at[b, kv])
    plgpu.wait_smem_to_gmem(0)


@contextlib.contextmanager
def stripped(producer: bool, consumer: bool):
    saved = paged_mgpu._convert_tile, paged_mgpu._consume
    if producer:  # each tile passed on as it landed: the float16 slot keeps what it held
        paged_mgpu._convert_tile = lambda *_: None
    if consumer:
        paged_mgpu._consume = _take_and_release
    try:
        yield
    finally:
        paged_mgpu._convert_tile, paged_mgpu._consume = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    B, ctx = 64, 4096
    q, _, (k8, v8), sc, lens, table = inputs(jax.random.PRNGKey(1), B, ctx, ctx)
    keys = int(jnp.sum(lens))
    fp8_bytes = 2 * keys * k8.shape[0] * k8.shape[-1]
    ref = reference.paged_attention_reference(q, k8, v8, lens, table, **sc)
    x = jnp.ones((fp8_bytes // 4,), jnp.bfloat16)
    copy_ms = common.device_ms(lambda x: x + 1, x, reps=args.reps)
    del x
    rows = dict(info=common.run_info(), batch=B, context=ctx, copy_ms=copy_ms)
    for name, prod, cons in (("full", False, False), ("no conversion", True, False),
                             ("no consumer math", False, True), ("pipeline only", True, True)):
        with stripped(prod, cons):
            jax.clear_caches()  # the kernel's own jit would hand back the previous variant
            fn = jax.jit(lambda q, k, v, l, t: K.paged_attention(q, k, v, l, t, backend="mosaic",
                                                                 num_splits=1, **sc))
            common.poison()
            out = fn(q, k8, v8, lens, table)
            ms = common.device_ms(fn, q, k8, v8, lens, table, reps=args.reps)
        err = common.rel_err(out, ref) if name == "full" else None
        rows[name] = dict(ms=ms, frac_of_copy_bw=copy_ms / ms, rel_err=err)
        print(f"{name}: {ms:.4f} ms, {copy_ms / ms:.0%} of copy"
              + ("" if err is None else f", rel err {err:.1e}"), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_fp8_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
