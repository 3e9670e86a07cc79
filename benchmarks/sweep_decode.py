"""Decode at the two target cases (batch 64 / context 4k, batch 1 / 32k), in one run: tile and
split variants of the Triton kernel (`kernels/paged.py`) and the Mosaic GPU kernel
(`kernels/paged_mgpu.py`), beside JAX's paged kernel and the copy ceiling; batch 64 / 4k again
with larger pages. `--short`: split counts at short contexts and batch 1-32 instead (what the
split-K rule in `kernels/tuning.py` rests on). Times are each call's kernels on the GPU
(`bench_kernels.device_ms`).

    python -m benchmarks.sweep_decode --out $OUT            # GPU, about 2 minutes
    python -m benchmarks.sweep_decode --short --out $OUT    # about 1.5 minutes

Prints one table last; writes every row to --out/sweep_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .attention import K, jax_paged_reference, paged_inputs
from .common import copy_ceiling, rel_err, run_info, time_ms
from pallasite.kernels import paged_mgpu, reference  # after .attention: it finds them in a checkout

H, KV, D = 32, 8, 128
# By batch: Triton variants (query rows per program, key tile, pipeline depth, warps, splits)
# and Mosaic GPU ones. Fewer rows per program (16 is wgmma's least) hold fewer registers and
# less shared memory, so more programs fit on an SM.
TRITON = {
    64: [dict(block_rows=r, pages_per_block=ppb, num_stages=st)
         for r in (16, 32, 64) for ppb, st in ((4, 3), (2, 4), (2, 6), (8, 2))]
        + [dict(block_rows=16, pages_per_block=4, num_stages=3, num_warps=w) for w in (2, 8)]
        + [dict(num_splits=2, block_rows=16, pages_per_block=4, num_stages=3)]
        # less shared memory per program, so that all 512 programs fit on the SMs at once
        + [dict(block_rows=64, pages_per_block=ppb, num_stages=st)
           for ppb, st in ((2, 3), (2, 2), (1, 4), (1, 6), (4, 2))],
    1: [dict(num_splits=sp, block_rows=r, pages_per_block=4, num_stages=st)
        for sp in (16, 32) for r in (16, 64) for st in (3, 4)],
}
MOSAIC = {64: [dict(block_k=128, num_stages=2, num_splits=1)],
          1: [dict(block_k=128, num_stages=2, num_splits=16)]}
PAGE_SIZES = (32, 64)  # batch 64 / 4k again with larger pages: ours and JAX's paged kernel
# Short contexts (a serving step's usual case), where the split merge's own launch may cost more
# than the splits save: (batch, context) by split count.
SHORT = [(b, c) for b in (1, 8) for c in (256, 512, 1024, 2048)] + [
    (8, 4096), (8, 32768), (16, 1024), (16, 4096), (32, 1024), (32, 4096)]
SHORT_SPLITS = (1, 2, 4, 8, 16)


def inputs(rng, B, C, page_size=16):
    q, kp, vp, _, ctx, table = paged_inputs(rng, [1] * B, [C] * B, H, KV, D, page_size,
                                           jnp.bfloat16)
    return (q.reshape(B, H, D), kp, vp, ctx, table), 2 * B * C * KV * D * 2


def triton(**kw):
    return lambda q, kp, vp, ctx, table: K.paged_attention(q, kp, vp, ctx, table, impl="pallas",
                                                           backend="triton", **kw)


def sweep_targets(row, rng, batches, page_sizes):
    """The two targets by variant, then batch 64 / 4k with larger pages; each variant checked
    against the reference."""
    cases = [(B, C, 16) for B, C in ((64, 4096), (1, 32768)) if B in batches]
    for B, C, ps in cases + [(64, 4096, ps) for ps in page_sizes]:
        case = f"B={B} ctx={C}" + (f" page={ps}" if ps != 16 else "")
        args, nbytes = inputs(rng, B, C, ps)
        ref = jax.jit(reference.paged_attention_reference)(*args)
        row(case, "jax paged", time_ms(jax_paged_reference, *args, device=True), nbytes)
        variants = [("triton", kw, triton(**kw)) for kw in (
            [dict()] + TRITON[B] if ps == 16 else [dict(), dict(block_rows=16)])]
        variants += [("mosaic", kw, lambda *a, kw=kw: paged_mgpu.paged_attention(*a, **kw))
                     for kw in (MOSAIC[B] if ps == 16 else [])]
        for name, kw, fn in variants:
            try:
                err = rel_err(jax.jit(fn)(*args), ref)
                row(case, f"{name} {kw}", time_ms(fn, *args, device=True), nbytes, err)
            except Exception as e:
                print(f"{case} {name} {kw}: FAILED {type(e).__name__}: {str(e)[:200]}")
        del args


def sweep_short(row, rng, cases):
    """Split counts of the Triton kernel at short contexts, beside what the rule picks."""
    for B, C in cases:
        args, nbytes = inputs(rng, B, C)
        for sp in [x for x in SHORT_SPLITS if x <= C // 64]:
            row(f"B={B} ctx={C}", f"triton splits={sp}",
                time_ms(triton(num_splits=sp), *args, device=True), nbytes)
        row(f"B={B} ctx={C}", "triton default", time_ms(triton(), *args, device=True), nbytes)
        del args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="64,1", help="which of the two targets to sweep")
    ap.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)))
    ap.add_argument("--short", action="store_true", help="the short-context split sweep")
    ap.add_argument("--cases", help="--short: these batch x context cases, e.g. 8x4096,16x1024")
    args = ap.parse_args()
    rows, rng = [], np.random.default_rng(7)
    ceiling = copy_ceiling()["best"]

    def row(case, name, ms, nbytes, err=None):
        r = dict(case=case, name=name, ms=ms, err=err,
                 frac_of_copy=nbytes / (ms / 1e3) / 1e12 / ceiling if ms else None)
        rows.append(r)
        print(f"{case} {name}: {ms} ms, {r['frac_of_copy']}, err {err}", flush=True)

    if args.short:
        sweep_short(row, rng, SHORT if not args.cases else [
            tuple(map(int, c.split("x"))) for c in args.cases.split(",")])
    else:
        sweep_targets(row, rng, [int(b) for b in args.batches.split(",")],
                      [int(p) for p in args.page_sizes.split(",") if p])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_decode.json").write_text(json.dumps(dict(
        **run_info(), copy_tbps=ceiling, rows=rows), indent=1))
    print(f"\ncopy ceiling {ceiling:.2f} TB/s\n| case | variant | ms | of copy | rel err |")
    print("|---|---|---|---|---|")
    for r in rows:
        f = r["frac_of_copy"]
        print(f"| {r['case']} | {r['name']} | {r['ms'] and round(r['ms'], 4)} | "
              f"{'-' if not f else f'{100 * f:.0f}%'} | {r['err'] and round(r['err'], 4)} |")


if __name__ == "__main__":
    main()
