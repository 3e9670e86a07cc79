"""Tiles of the ragged paged-attention kernel (`kernels/paged.py`, the Triton lowering) for the
steps it runs: mixed prefill + decode steps and pure prefill chunks over paged K/V.

    python -m benchmarks.sweep_ragged --out DIR [--mosaic]   # H100, about 2 minutes
    python -m benchmarks.sweep_ragged --tiny --out DIR    # CPU, interpret mode (does it run)

Cases (32 heads / 8 KV heads, head dim 128, bf16, pages of 16):
- fa3_mixed: a 512-token chunk over 8k of context plus 63 decode rows at 4k (the mixed step of
  `bench_kernels --only fa3`), against FlashAttention-3's two calls when `flash-attn3-jax` is
  installed; chunk_8k: its chunk alone;
- sharegpt_mixed: 30 fresh prompt chunks of 256 tokens plus 512 decode rows at context 320 (the
  offline ShareGPT run's mixed step);
- prefill_2k: one 2048-token prompt;
- paced: a step of the paced offline run, a 56-token chunk (to 256 keys) and 200 decode rows
  at 400; decode_768: 768 decode rows at 320 (a large unpaced decode step);
  paced_decode and paced_chunk: the paced step's decode rows alone and its chunk alone;
  sharegpt_decode and sharegpt_chunks: the same halves of sharegpt_mixed;
- tail: one of the paced run's last steps, a 247-token chunk (keys 400-647) and 9 decode rows;
- paced_rows_first, tail_rows_first: those two with the decode rows first, as the scheduler
  packs a step (the kernel then runs their blocks without block metadata);
- decode_2k, mixed_2k: 64 decode rows at 2000 keys, and a 512-token chunk over 2000 beside 63
  decode rows at 1800 (a 2048-token model's page table, full).
A case of decode rows only also times the decode kernel (`kernels.paged_attention`, one token a
sequence, no block metadata; with --mosaic the Mosaic GPU one too).
`--variants 64/64/4/3,64/32/4/3` names the tiles to time instead of VARIANTS, and
`--decode-variants` times the decode kernel at them too in cases of decode rows only.
`--splits 1,2,4` also times the library's own tiles at each of those key splits;
`--decode-options` times them with `hoist_decode` on and off (`paged.py`).
`--pad-seqs 256` pads each case to 256 sequences of no token and no context, as the engine's
step of 256 tokens has them (its page table has a row for each token).

"library" is `kernels.ragged_paged_attention` choosing for itself, as the engine calls it. With
--fp8 every case runs on float8 pages with per-kv-head scales (FA3 is left out);
`--fp8-dots f16,e4m3` adds a few tiles at each of those ways of meeting q (`paged.py` fp8_dot).

With --mosaic (16-bit pages only: not with --fp8), the Mosaic GPU kernel
(`paged_mgpu.ragged_paged_attention`: a CTA's 64 rows are a block of one sequence's tokens
times their query heads, K/V pages by TMA, warpgroup MMAs) runs beside it at its own tiles and
splits, and a 512-token chunk over 8k runs alone too.
`--programs 132,264` adds its one-split tiles with that many persistent CTAs, each walking
every programs-th (block, kv head) through one TMA ring (and, for decode rows only, the Mosaic
decode kernel at the library's tiles so).

Every variant (block_rows, block_k, num_warps, num_stages; splits by the library's rule) is
first checked against the jnp reference on fresh random inputs with freed memory poisoned, then
timed (GPU time of its kernels, L2 flushed before each call, median of --reps). Writes
DIR/sweep_ragged.json and prints each case's variants, fastest first.
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
CASES = {"fa3_mixed": ([512] + [1] * 63, [8192] + [4096] * 63),
         "chunk_8k": ([512], [8192]),
         "sharegpt_mixed": ([256] * 30 + [1] * 512, [256] * 30 + [320] * 512),
         "prefill_2k": ([2048], [2048]),
         # a step of the paced offline run (serving/scheduler.py): a chunk and 200 decode rows
         "paced": ([56] + [1] * 200, [256] + [400] * 200),
         "decode_768": ([1] * 768, [320] * 768),
         "paced_decode": ([1] * 200, [400] * 200),
         "paced_chunk": ([56], [256]),
         # one of the paced run's last steps: a long prompt's chunk and a few decode rows
         "tail": ([247] + [1] * 9, [647] + [500] * 9),
         # the same two steps with their decode rows first, as the scheduler packs a step
         "paced_rows_first": ([1] * 200 + [56], [400] * 200 + [256]),
         "tail_rows_first": ([1] * 9 + [247], [500] * 9 + [647]),
         "sharegpt_decode": ([1] * 512, [320] * 512),
         "sharegpt_chunks": ([256] * 30, [256] * 30),
         # contexts toward a 2048-token model's end: 64 decode rows, and a chunk beside them
         "decode_2k": ([1] * 64, [2000] * 64),
         "mixed_2k": ([512] + [1] * 63, [2000] + [1800] * 63)}
TINY = {"mixed": ([32] + [1] * 5, [96] + [40] * 5), "decode": ([1] * 5, [40] * 5)}
# (block_rows, block_k, num_warps, num_stages); the first is the H100's table entry today
VARIANTS = [(64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 8, 3), (64, 64, 8, 3), (128, 64, 8, 3),
            (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
            # fewer rows a program (fewer registers, more programs an SM) for short tables
            (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 2), (16, 64, 2, 3), (32, 64, 4, 3)]
# With --fp8-dots: these tiles (block_rows, block_k, num_warps, num_stages) at each float8 path
# named (`paged.py` fp8_dot): the ragged tiles, the float8 decode tiles, and a stage less
FP8_TILES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (16, 128, 4, 2), (16, 64, 4, 3)]
# The Mosaic GPU kernel (`paged_mgpu.ragged_paged_attention`, Hopper): (block_k, num_stages,
# num_splits)
MOSAIC = [(64, 2, 1), (64, 2, 2), (64, 2, 4), (64, 3, 2), (128, 2, 1), (128, 2, 2), (128, 2, 4)]
# The Mosaic GPU decode kernel with --programs: (block_k, num_stages), the rest as the
# library's entry
DECODE = [(128, 2), (64, 3), (64, 4), (128, 3)]



def fa3_two_calls(q, kp, vp, ctx, table, chunk):
    """FA3's chunk call and decode call (`fa3.two_calls`, best num_splits of 1, 2, 4), or None."""
    from .fa3 import fa3, fa3_pages, two_calls
    f = fa3()
    if f is None:
        return None
    kc, vc = fa3_pages(kp), fa3_pages(vp)
    return min(common.device_times([(jax.jit(two_calls(f, chunk, n)), (q, kc, vc, ctx, table))],
                                   20)[0][0] for n in (1, 2, 4))


def run_case(name, q_lens, ctx, args):
    rng = np.random.default_rng(len(q_lens))
    if len(q_lens) < args.pad_seqs:  # the engine's bucket: rows of no token and no context
        q_lens, ctx = (list(x) + [0] * (args.pad_seqs - len(q_lens)) for x in (q_lens, ctx))
    q, kp, vp, qs, ctx_a, table = paged_inputs(rng, q_lens, ctx, H if not args.tiny else 4,
                                               KV if not args.tiny else 2, D if not args.tiny
                                               else 64, PAGE, jnp.bfloat16)
    sc = {}
    if args.fp8:
        (kp, vp), sc = fp8_pages(kp, vp)
    ref = jax.jit(lambda *a: reference.ragged_paged_attention_reference(*a, **sc))(
        q, kp, vp, qs, ctx_a, table)
    jobs = [(dict(kernel="library"), jax.jit(lambda *a: K.ragged_paged_attention(
        *a, interpret=args.tiny, **sc)))]
    variants = args.variants or ([] if args.library else VARIANTS[:2] if args.tiny
                                 else VARIANTS)
    for rows, bk, warps, stages in variants:
        kw = dict(block_rows=rows, pages_per_block=bk // PAGE, num_warps=warps, num_stages=stages)
        jobs.append((dict(kernel="triton", block_rows=rows, block_k=bk, num_warps=warps,
                          num_stages=stages), jax.jit(lambda *a, kw=kw: K.ragged_paged_attention(
                              *a, interpret=args.tiny, **kw, **sc))))
    for dot in args.fp8_dots if args.fp8 else []:
        for rows, bk, warps, stages in FP8_TILES[:1] if args.tiny else FP8_TILES:
            kw = dict(block_rows=rows, pages_per_block=bk // PAGE, num_warps=warps,
                      num_stages=stages, fp8_dot=dot)
            jobs.append((dict(kernel="triton", block_rows=rows, block_k=bk, num_warps=warps,
                              num_stages=stages, fp8_dot=dot), jax.jit(
                lambda *a, kw=kw: K.ragged_paged_attention(*a, interpret=args.tiny, **kw,
                                                           **sc))))
    if all(n == 1 for n in q_lens):  # one token a sequence: the decode kernel takes it too
        for backend in ("triton", "mosaic") if args.mosaic else ("triton",):
            jobs.append((dict(kernel="decode", backend=backend), jax.jit(
                lambda q, kp, vp, qs, c, t, b=backend: K.paged_attention(
                    q, kp, vp, c, t, backend=b, interpret=args.tiny, **sc))))
        for rows, bk, warps, stages in variants if args.decode_variants else ():
            kw = dict(block_rows=rows, pages_per_block=bk // PAGE, num_warps=warps,
                      num_stages=stages)
            jobs.append((dict(kernel="decode", backend="triton", block_rows=rows, block_k=bk,
                              num_warps=warps, num_stages=stages), jax.jit(
                lambda q, kp, vp, qs, c, t, kw=kw: K.paged_attention(
                    q, kp, vp, c, t, backend="triton", interpret=args.tiny, **kw, **sc))))
    for n in args.splits:
        jobs.append((dict(kernel="library", num_splits=n), jax.jit(
            lambda *a, n=n: K.ragged_paged_attention(*a, interpret=args.tiny, num_splits=n,
                                                     **sc))))
    for hoist in (True, False) if args.decode_options else ():  # the library's tiles so
        jobs.append((dict(kernel="library", hoist_decode=hoist), jax.jit(
            lambda *a, h=hoist: K.ragged_paged_attention(*a, interpret=args.tiny,
                                                         hoist_decode=h, **sc))))
    if args.mosaic:
        from pallasite.kernels import paged_mgpu
        tiles = [dict(zip(("block_k", "num_stages", "num_splits"), t)) for t in MOSAIC]
        tiles += [dict(t, programs=p) for p in args.programs for t in tiles
                  if t["num_splits"] == 1]
        if all(n == 1 for n in q_lens):  # the decode kernel at the library's tiles and more
            entry = tuning.params("decode_mosaic")
            for p in args.programs:
                for t in DECODE:
                    tile = dict(zip(("block_k", "num_stages"), t))
                    kw = dict(entry, **tile, num_splits=1, programs=p)
                    jobs.append((dict(kernel="decode", backend="mosaic", programs=p, **tile),
                                 jax.jit(lambda q, kp, vp, qs, c, t, kw=kw:
                                         paged_mgpu.paged_attention(q, kp, vp, c, t,
                                                                    interpret=args.tiny, **kw))))
        for kw in tiles[:1] if args.tiny else tiles:
            jobs.append((dict(kernel="mosaic", **kw), jax.jit(
                lambda *a, kw=kw: paged_mgpu.ragged_paged_attention(*a, interpret=args.tiny,
                                                                    **kw))))
    records, calls = [], []
    for desc, fn in jobs:
        rec = dict(case=name, **desc)
        common.poison()
        try:
            rec["rel_err"] = common.rel_err(fn(q, kp, vp, qs, ctx_a, table), ref)
        except Exception as e:  # a tile that does not compile is recorded, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if rec.get("rel_err") is not None and rec["rel_err"] <= 1e-2:
            calls.append((rec, fn))
        records.append(rec)
    times = common.device_times([(fn, (q, kp, vp, qs, ctx_a, table)) for _, fn in calls],
                                args.reps)
    for (rec, _), (ms, _) in zip(calls, times):
        rec["ms"] = ms
    base = {}
    if name == "fa3_mixed" and not args.tiny and not args.fp8:
        base["fa3_two_calls_ms"] = fa3_two_calls(q, kp, vp, ctx_a, table, q_lens[0])
    for rec in records:
        rec.update(base)
    return records


def label(r) -> str:
    programs = f"/{r['programs']}p" if "programs" in r else ""
    opts = {True: " +hoist_decode", False: " -hoist_decode"}.get(r.get("hoist_decode"), "")
    if r["kernel"] == "decode" and "num_warps" in r:
        return (f"decode kernel ({r['backend']} {r['block_rows']}/{r['block_k']}/"
                f"{r['num_warps']}w/{r['num_stages']}s)")
    if r["kernel"] == "decode":
        tile = "".join(f"/{r[k]}" for k in ("block_k", "num_stages") if k in r)
        return f"decode kernel ({r['backend']}{tile}{programs}){opts}"
    if r["kernel"] == "library":
        return ("library" + (f" {r['num_splits']} splits" if "num_splits" in r else "")
                + opts)
    if r["kernel"] == "mosaic":
        return f"mosaic {r['block_k']}/{r['num_stages']}s/{r['num_splits']}sp{programs}"
    dot = f"/{r['fp8_dot']}" if "fp8_dot" in r else ""
    return f"{r['block_rows']}/{r['block_k']}/{r['num_warps']}w/{r['num_stages']}s{dot}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--library", action="store_true",
                    help="only the library's own tiles (and the decode kernel), no sweep")
    ap.add_argument("--variants", type=lambda s: [tuple(int(x) for x in v.split("/"))
                                                  for v in s.split(",")], default=None,
                    help="these tiles block_rows/block_k/num_warps/num_stages instead of "
                         "VARIANTS, e.g. 64/64/4/3,64/32/4/3")
    ap.add_argument("--decode-variants", action="store_true",
                    help="cases of decode rows only: also the decode kernel at the variants")
    ap.add_argument("--splits", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="also the library's tiles at these key splits")
    ap.add_argument("--decode-options", action="store_true",
                    help="also the library's tiles with the kernel's hoist_decode on and off")
    ap.add_argument("--mosaic", action="store_true",
                    help="also the Mosaic GPU ragged kernel (Hopper, 16-bit pages), at its "
                         "tiles and splits")
    ap.add_argument("--programs", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="with --mosaic, also its one-split tiles with this many persistent CTAs")
    ap.add_argument("--pad-seqs", type=int, default=0,
                    help="pad each case to this many sequences (no tokens, no context), as "
                         "the engine's bucket pads a step's rows")
    ap.add_argument("--fp8", action="store_true",
                    help="float8 pages with per-kv-head scales (the FP8 KV cache)")
    ap.add_argument("--fp8-dots", type=lambda s: s.split(","), default=[],
                    help="with --fp8, also FP8_TILES at each of these float8 paths "
                         "(paged.FP8_DOTS: q, f16, f16_swap, e4m3, ...)")
    args = ap.parse_args(argv)
    if args.mosaic and args.fp8:
        ap.error("--mosaic takes 16-bit pages: float8 V pages are keys-last, which the Mosaic "
                 "GPU kernel does not read")
    info = common.run_info()
    print(json.dumps(info), flush=True)
    cases = TINY if args.tiny else {c: CASES[c] for c in args.cases.split(",")}
    records = []
    for name, (q_lens, ctx) in cases.items():
        recs = run_case(name, q_lens, ctx, args)
        records += recs
        timed = sorted((r for r in recs if "ms" in r), key=lambda r: r["ms"])
        fa3 = recs[0].get("fa3_two_calls_ms")
        print(f"{name}: " + ("" if fa3 is None else f"FA3 two calls {fa3:.4f} ms; ") +
              "  ".join(f"{label(r)} {r['ms']:.4f}" for r in timed), flush=True)
        for r in recs:
            if "error" in r or "ms" not in r:
                print(f"  {name} {r}: not timed", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_ragged.json"), "w") as f:
            json.dump(dict(info, records=records), f, indent=1)
    return records


if __name__ == "__main__":
    main()
