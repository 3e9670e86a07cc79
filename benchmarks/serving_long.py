"""The long-context mode of the serving benchmark: a few long conversations at once, the zone of
RAG, agents and chat with history. The engine on the 8B-shaped model (random bf16 weights), for
each shape N x C: N requests whose prompts are C tokens of random ids, 128 new tokens each (EOS
ignored), submitted together; the time of the steps that carry prompt tokens (`prefill_s`, the
first step's excluded), then the pure-decode steps (all N rows decoding) against their
roofline (benchmarks/step_budget.py: weights plus every row's K/V at the copy bandwidth measured
in the run, or the FLOPs at the dense bf16 peak if larger).

    python -m benchmarks.bench_serving --long-context 1x640,8x8192,32x2048 --out DIR   # GPU
    python -m benchmarks.bench_serving --long-context 1x40,4x200 --tiny --out DIR      # CPU

`--kv-cache-dtype fp8` runs the engine on float8 pages (the roofline counts their bytes).

The first shape is the reference (by default batch 1 at 640 tokens, where decode runs near its
roofline): each record carries `vs_reference`, its fraction of roofline over the reference's.
One engine serves every shape (sized for the largest), so the shapes differ only in the batch.
Writes DIR/serving_long.json (records with mode "long_context") and prints a table.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import step_budget
from .serving_sharegpt import MODEL, TINY, requests, step_times

NEW_TOKENS = 128
PAGE = 16


def shapes_arg(s: str) -> list[tuple[int, int]]:
    """'1x640,8x8192' -> [(1, 640), (8, 8192)]: sequences x prompt tokens."""
    out = []
    for part in s.split(","):
        n, _, c = part.partition("x")
        if not (n.isdigit() and c.isdigit() and int(n) > 0 and int(c) > 0):
            raise ValueError(f"--long-context {part!r}: write SEQSxTOKENS, e.g. 8x8192")
        out.append((int(n), int(c)))
    return out


def build(args, shapes):
    """An engine whose buckets fit every shape: its longest prompt plus the new tokens, all the
    sequences of the largest batch at once, one page-table width per context."""
    from pallasite.model import config_from_dict, init_params
    from pallasite.model.fuse import fuse_params
    from pallasite.serving.engine import Engine, min_token_bucket
    from pallasite.serving.llm import kv_cache_dtype_of
    from pallasite.serving.settings import engine_sizes
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    kv_dtype = kv_cache_dtype_of(args.kv_cache_dtype) or dtype
    max_len = max(c for _, c in shapes) + NEW_TOKENS
    model = dict(TINY if args.tiny else MODEL)  # positions as far as the longest (Llama 3.1: 128k)
    model["max_position_embeddings"] = max(model["max_position_embeddings"], max_len)
    config = config_from_dict(dict(model_type="llama", **model))
    params = fuse_params(jax.jit(lambda: init_params(config, args.seed, dtype))())
    seqs = max(n for n, _ in shapes)
    need = sum(n * -(-(c + NEW_TOKENS) // PAGE) for n, c in shapes)
    sizes = engine_sizes(config, kv_dtype, max_model_len=max_len, page_size=PAGE, max_num_seqs=seqs,
                         max_num_batched_tokens=2048 if args.tiny else 8192,
                         first_bucket=min_token_bucket(params))
    sizes["num_pages"] = max(sizes["num_pages"], need + 8)  # each shape's pages stay cached
    widths = sorted({-(-(c + NEW_TOKENS) // PAGE) for _, c in shapes})
    engine = Engine(config, params, page_size=PAGE, max_model_len=max_len, page_buckets=widths,
                    kv_cache_dtype=kv_dtype, **sizes)
    return config, engine


def run_shape(engine, config, n, ctx, seed) -> tuple[list, float]:
    """Serve n prompts of ctx tokens; the step log and the wall time."""
    from .bench_serving import run
    reqs = requests([(ctx, NEW_TOKENS)] * n, config.vocab_size, seed, f"long{n}x{ctx}-")
    engine.step_log = []
    outs, wall = run(engine, reqs, time.perf_counter() + 600)
    log, engine.step_log = engine.step_log, None
    if sum(len(o.new_token_ids) for o in outs) != n * NEW_TOKENS:
        raise SystemExit(f"{n}x{ctx}: not every request produced {NEW_TOKENS} tokens")
    return log, wall


def record(cost, log, n, ctx, bw, peak) -> dict:
    """The pure-decode steps with all n rows: median time against the mean roofline."""
    timed = step_times(log)
    steps = [(e, dt) for e, dt in timed if e["tokens"] == e["decode_rows"] == n]
    if not steps:
        raise SystemExit(f"{n}x{ctx}: no pure-decode step with {n} rows was logged")
    budgets = [step_budget.budget(cost, e, bw, peak) for e, _ in steps]
    dt = float(np.median([d for _, d in steps]))
    roof = float(np.mean([b["roofline_s"] for b in budgets]))
    kv = float(np.mean([cost.kv_bytes_per_token * e["context_tokens"] for e, _ in steps]))
    prefill = [d for e, d in timed if e["tokens"] > e["decode_rows"]]
    return dict(mode="long_context", sequences=n, context=ctx, new_tokens=NEW_TOKENS,
                prefill_steps=len(prefill), prefill_s=float(sum(prefill)),
                decode_steps=len(steps), decode_step_ms=1e3 * dt, roofline_ms=1e3 * roof,
                memory_ms=1e3 * float(np.mean([b["memory_s"] for b in budgets])),
                compute_ms=1e3 * float(np.mean([b["compute_s"] for b in budgets])),
                frac_of_roofline=roof / dt, kv_gb_per_step=kv / 1e9,
                weight_gb=cost.weight_bytes / 1e9,
                host_ms=1e3 * float(np.median([e.get("host_s", np.nan) for e, _ in steps])),
                wait_ms=1e3 * float(np.median([e.get("wait_s", np.nan) for e, _ in steps])),
                output_tok_per_s=n / dt)


def main(args):
    from pallasite.kernels import choose_impl
    from .common import copy_bandwidth, run_info
    shapes = args.long_context
    env = dict(**run_info(), attention=choose_impl(),
               model="tiny" if args.tiny else "llama3-8b-shaped",
               kv_cache_dtype=args.kv_cache_dtype,
               ragged_backend=os.environ.get("PALLASITE_RAGGED_BACKEND", "default"))
    print(json.dumps(env), flush=True)
    bw, how = copy_bandwidth(gb=0.05 if args.tiny else 4)
    peak = step_budget.peak_bf16(env["gpu"]) or (1e12 if args.tiny else None)
    if peak is None:
        raise SystemExit(f"no dense bf16 peak known for {env['gpu']!r}: add it to "
                         "benchmarks/step_budget.py PEAK_BF16")
    config, engine = build(args, shapes)
    cost = step_budget.model_cost(config, itemsize=4 if args.tiny else 2,
                                  kv_itemsize=1 if args.kv_cache_dtype == "fp8" else None)
    t = time.perf_counter()
    engine.warmup(workers=args.workers)
    env.update(warmup_s=time.perf_counter() - t, copy_tbps=bw / 1e12, copy_how=how,
               peak_tflops=peak / 1e12, pages_total=engine.pages.num_pages,
               token_buckets=engine.token_buckets)
    records = []
    for i, (n, ctx) in enumerate(shapes):
        log, wall = run_shape(engine, config, n, ctx, args.seed + i)
        rec = {**env, **record(cost, log, n, ctx, bw, peak), "wall_s": wall}
        rec["vs_reference"] = rec["frac_of_roofline"] / (records or [rec])[0]["frac_of_roofline"]
        records.append(rec)
        print(json.dumps(rec), flush=True)
        save(records, args.out)
    print(table(records))
    return records


def save(records, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serving_long.json"), "w") as f:
        json.dump(records, f, indent=1)


def table(records) -> str:
    lines = ["| shape | decode step ms | roofline ms (memory / compute) | of roofline "
             "| vs the first shape | K/V GB a step | host / wait ms |", "|" + "---|" * 7]
    for r in records:
        lines.append(f"| {r['sequences']} x {r['context']} | {r['decode_step_ms']:.2f} | "
                     f"{r['roofline_ms']:.2f} ({r['memory_ms']:.2f} / {r['compute_ms']:.2f}) | "
                     f"{r['frac_of_roofline']:.0%} | {r['vs_reference']:.2f}x | "
                     f"{r['kv_gb_per_step']:.2f} | {r['host_ms']:.2f} / {r['wait_ms']:.2f} |")
    return "\n".join(lines)


def add_arguments(ap):
    ap.add_argument("--long-context", type=shapes_arg, default=None,
                    help="SEQSxTOKENS[,...]: the long-context mode (benchmarks/serving_long.py), "
                         "e.g. 1x640,8x8192,32x2048; the first shape is the reference")
