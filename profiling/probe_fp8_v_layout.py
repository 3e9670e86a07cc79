"""Float8 decode with V pages keys-last ([KV, P, D, page_size], `reference.keys_last`), the
Triton kernel at a few tiles, against bf16 pages.

    python -m profiling.probe_fp8_v_layout --out DIR     # GPU, about two minutes
    python -m profiling.probe_fp8_v_layout --tiny        # CPU, interpret mode (does it run)

Stored [page_size, D], the converted float8 V tile went back through shared memory before it
could be P V's MMA operand; keys-last it goes from registers, as K's does
(`profiling/triton_offline.py` shows both). Cases (32 query / 8 kv heads of 128, pages of 16):
200 rows at 400 keys, 768 at 320, 64 at 4096, 8 at 8192, 1 at 32768. Every call is checked
against the reference on fresh random pages with freed memory poisoned, then timed
(`common.device_times`, the L2 flushed before each call). Writes DIR/probe_fp8_v_layout.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.attention import paged_inputs
from benchmarks.sweep_fp8kv import fp8_pages
from pallasite import kernels as K
from pallasite.kernels import reference, tuning

H, KV, D, PAGE = 32, 8, 128, 16
CASES = {"paced_decode": (200, 400), "decode_768": (768, 320), "b64_4k": (64, 4096),
         "b8_8k": (8, 8192), "b1_32k": (1, 32768)}
# (block_rows, block_k, num_warps, num_stages) on keys-last V pages
TILES = [(16, 64, 4, 3), (16, 128, 4, 2), (16, 64, 4, 4)]


def run_case(name, seqs, ctx, args):
    rng = np.random.default_rng(seqs)
    h, kv, d = (H, KV, D) if not args.tiny else (4, 2, 64)
    q, kp, vp, _, ctx_a, table = paged_inputs(rng, [1] * seqs, [ctx] * seqs, h, kv, d, PAGE,
                                              jnp.bfloat16)
    (k8, v8), sc = fp8_pages(kp, vp)  # V keys-last
    ref16 = jax.jit(reference.paged_attention_reference)(q, kp, vp, ctx_a, table)
    ref8 = jax.jit(lambda *a: reference.paged_attention_reference(*a, **sc))(
        q, k8, v8, ctx_a, table)
    pal = dict(interpret=args.tiny)
    jobs = [(dict(kernel="bf16 library"), (q, kp, vp, ctx_a, table), ref16,
             lambda *a: K.paged_attention(*a, **pal)),
            (dict(kernel="fp8 library"), (q, k8, v8, ctx_a, table), ref8,
             lambda *a: K.paged_attention(*a, **sc, **pal))]
    for rows, bk, warps, stages in TILES[:1] if args.tiny else TILES:
        tiles = -(-table.shape[1] // (bk // PAGE))
        kw = dict(block_rows=rows, pages_per_block=bk // PAGE, num_warps=warps,
                  num_stages=stages, fp8_dot="f16",
                  num_splits=tuning.num_splits(seqs * kv, tiles), **pal)
        jobs.append((dict(kernel="fp8 triton", block_rows=rows, block_k=bk, num_warps=warps,
                          num_stages=stages, num_splits=kw["num_splits"]),
                     (q, k8, v8, ctx_a, table), ref8,
                     lambda *a, kw=kw: K.paged_attention(*a, **sc, **kw)))
    records, calls = [], []
    for desc, call_args, ref, fn in jobs:
        rec = dict(case=name, seqs=seqs, context=ctx, fp8_bytes=2 * seqs * ctx * kv * d, **desc)
        f = jax.jit(fn)
        common.poison()
        try:
            rec["rel_err"] = common.rel_err(f(*call_args), ref)
        except Exception as e:  # a tile that does not compile is recorded, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if rec.get("rel_err") is not None and rec["rel_err"] <= 2e-2:
            calls.append((rec, f, call_args))
        records.append(rec)
    times = common.device_times([(f, a) for _, f, a in calls], args.reps)
    for (rec, _, _), (ms, _) in zip(calls, times):
        rec["ms"] = ms
        rec["fp8_tbps"] = rec["fp8_bytes"] / (ms * 1e-3) / 1e12
    return records


def label(r) -> str:
    tile = "".join(f"/{r[k]}" for k in ("block_rows", "block_k", "num_warps", "num_stages")
                   if k in r)
    return r["kernel"] + tile


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    info = common.run_info(device=not args.tiny)
    if not args.tiny:
        info["copy_tbps"] = common.copy_ceiling()
    cases = {"tiny": (3, 150)} if args.tiny else CASES
    records = []
    for name, (seqs, ctx) in cases.items():
        recs = run_case(name, seqs, ctx, args)
        records += recs
        ok = sorted((r for r in recs if "ms" in r), key=lambda r: r["ms"])
        print(f"{name}: " + "  ".join(f"{label(r)} {r['ms']:.4f}" for r in ok), flush=True)
        for r in recs:
            if "ms" not in r:
                print(f"  {r['kernel']}: {r.get('error') or r.get('rel_err')}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_fp8_v_layout.json"), "w") as f:
            json.dump(dict(info, records=records), f, indent=1)


if __name__ == "__main__":
    main()
