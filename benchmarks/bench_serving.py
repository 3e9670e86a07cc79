"""Serving benchmark of the engine on a Llama-3-8B-shaped model (random bf16 weights made on the
device), with the copy bandwidth measured in the same run for the roofline.

    python -m benchmarks.bench_serving --offline --out DIR     # GPU
    python -m benchmarks.bench_serving --offline --tiny        # a tiny model, as a CPU dry run
    python -m benchmarks.bench_serving --online ...     # handed to benchmarks/bench_online.py
    python -m benchmarks.bench_serving --sharegpt offline|online --out DIR   # the ShareGPT
        workload with the engine's own sizes: benchmarks/serving_sharegpt.py
    python -m benchmarks.bench_serving --long-context 1x640,8x8192,32x2048 --out DIR   # a few
        long conversations at once against batch 1: benchmarks/serving_long.py

--offline measures (a) batch-1 decode latency per token, with and without the engine's
one-step-ahead overlap, and (b) throughput of 512 requests (prompts uniform in 128..2048 tokens,
outputs in 64..512) submitted at once. A step's roofline is the bytes it must read (every weight
but the embedding table, whose rows are gathered, plus the K/V of every scheduled token's
context) over the copy bandwidth. Writes OUT/serving.json (records) and OUT/serving.md (table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import serving_long, serving_sharegpt
from .common import run_info


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offline", action="store_true", help="batch-1 latency and offline throughput")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--time-limit", type=float, default=540, help="seconds for the whole run")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-fraction", type=float, default=0.6,
                    help="share of the device memory left after the weights given to KV pages")
    ap.add_argument("--token-buckets", default=None, help="comma-separated token-axis buckets")
    ap.add_argument("--page-buckets", default=None, help="comma-separated page-table widths")
    ap.add_argument("--workers", type=int, default=8, help="parallel compilations in warm-up")
    ap.add_argument("--seed", type=int, default=0)
    serving_sharegpt.add_arguments(ap)
    serving_long.add_arguments(ap)
    ap.add_argument("--tuning", action="append", default=[],
                    help="NAME=JSON: this GPU's kernel tuning entry replaced (null: dropped), "
                         "to time an earlier setting against the table's")
    return ap.parse_args(argv)


# -- setup -------------------------------------------------------------------------------------
def workload(args):
    """Model shape and request mix: the issue's, or a tiny one."""
    if args.tiny:
        model = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return model, dict(requests=24, prompt=(16, 64), output=(8, 32), b1_prompt=32, b1_tokens=32,
                           max_num_seqs=8, budget=64, dtype=jnp.float32)
    model = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0)
    return model, dict(requests=512, prompt=(128, 2048), output=(64, 512), b1_prompt=512,
                       b1_tokens=256, max_num_seqs=256, budget=2048, dtype=jnp.bfloat16)


def copy_bandwidth(tiny: bool) -> tuple[float, str]:
    """Bytes read + written per second by a device copy (the probe's measurement)."""
    from .common import copy_bandwidth as probe
    return probe(gb=0.05 if tiny else 4)


def kv_bytes_per_token(config, dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def bytes_read_per_step(params, config) -> int:
    """Weights a decode step reads: all of them, except the embedding table when it is not also
    the output projection (only the scheduled tokens' rows are gathered from it)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total if config.tie_word_embeddings else total - params["embed"].nbytes


def make_engine(config, params, args, mix):
    from pallasite.kernels import choose_impl
    from pallasite.serving.engine import Engine
    from pallasite.serving.llm import default_num_pages
    reference = choose_impl() == "reference" and not args.tiny
    # The jnp reference attention materializes K/V per query token: keep its steps small.
    max_num_seqs = args.max_num_seqs or min(128 if reference else 10**9, mix["max_num_seqs"])
    budget = args.max_num_batched_tokens or (256 if reference else mix["budget"])
    max_model_len = mix["prompt"][1] + mix["output"][1]
    num_pages = None
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        page = kv_bytes_per_token(config, mix["dtype"]) * args.page_size
        num_pages = int(args.kv_fraction * (stats["bytes_limit"] - stats["bytes_in_use"]) // page)
    num_pages = num_pages or default_num_pages(config, args.page_size, mix["dtype"], max_model_len,
                                               max_num_seqs)
    max_pages = -(-max_model_len // args.page_size)
    tokens = [int(b) for b in args.token_buckets.split(",")] if args.token_buckets else \
        sorted({min(2 ** i, budget) for i in range(budget.bit_length())})
    # Page tables as wide as the batch-1 context, and as max_model_len: 2 x len(tokens) programs.
    b1_pages = -(-(mix["b1_prompt"] + mix["b1_tokens"]) // args.page_size)
    pages = [int(b) for b in args.page_buckets.split(",")] if args.page_buckets else \
        sorted({b1_pages, max_pages})
    return Engine(config, params, num_pages=num_pages, page_size=args.page_size,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  max_model_len=max_model_len, token_buckets=tokens, page_buckets=pages)


# -- measurements -------------------------------------------------------------------------------
def step_times(log):
    """Each step's time: from the previous step's results to its own (device-bound in steady
    state, since the next step is already queued)."""
    return [(b, b["done"] - a["done"]) for a, b in zip(log, log[1:]) if "done" in a and "done" in b]


def run(engine, requests, deadline):
    """Submit everything, step until done or the deadline; returns (each request's last output
    with all its tokens, wall seconds). Outputs are folded in as `LLM.generate` does: keeping
    every step's outputs would leave the collector a heap that grows by two objects a token."""
    from pallasite.serving.llm import SamplingParams
    for rid, prompt, n in requests:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    t0, last, tokens = time.perf_counter(), {}, {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished() and time.perf_counter() < deadline:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    wall = time.perf_counter() - t0
    for rid in list(engine.seqs):  # out of time: stop the rest
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return [o._replace(new_token_ids=tokens[rid]) for rid, o in last.items()], wall


def batch1(engine, mix, cost, rng, overlap, deadline):
    engine.overlap, engine.step_log = overlap, []
    prompt = rng.integers(0, engine.config.vocab_size, mix["b1_prompt"]).tolist()
    outs, wall = run(engine, [("b1", prompt, mix["b1_tokens"])], deadline)
    steps = [(e, dt) for e, dt in step_times(engine.step_log) if e["tokens"] == 1]
    engine.step_log, engine.overlap = None, True
    ms = 1e3 * float(np.median([dt for _, dt in steps]))
    roof = 1e3 * float(np.mean([cost(e) for e, _ in steps]))
    return dict(mode="batch1", batch=1, overlap=overlap, step_ms=ms, roofline_ms=roof,
                frac_of_roofline=roof / ms, output_tok_per_s=1e3 / ms, decode_steps=len(steps),
                context=mix["b1_prompt"] + mix["b1_tokens"] // 2)


def offline(engine, mix, cost, rng, deadline):
    n = mix["requests"]
    reqs = [(f"r{i}", rng.integers(0, engine.config.vocab_size,
                                   rng.integers(mix["prompt"][0], mix["prompt"][1] + 1)).tolist(),
             int(rng.integers(mix["output"][0], mix["output"][1] + 1))) for i in range(n)]
    engine.step_log = []
    before = engine.stats()
    outs, wall = run(engine, reqs, deadline)
    log, engine.step_log = engine.step_log, None
    done = [o for o in outs if o.finished and o.finish_reason == "length"]
    decode = [(e, dt) for e, dt in step_times(log) if e["tokens"] == e["decode_rows"]]
    total = engine.pages.num_pages
    ttft = [o.first_token_time - o.arrival_time for o in done]
    after = engine.stats()
    rec = dict(mode="offline", requests=n, completed=len(done), wall_s=wall,
               output_tok_per_s=sum(len(o.new_token_ids) for o in outs) / wall,
               batch=float(np.mean([e["rows"] for e in log])),
               decode_batch=float(np.mean([e["rows"] for e, _ in decode])) if decode else 0.0,
               steps=len(log), decode_steps=len(decode),
               kv_occupancy_mean=float(np.mean([e["pages_used"] for e in log])) / total,
               kv_occupancy_max=max(e["pages_used"] for e in log) / total, pages_total=total,
               preemptions=after["preemptions"] - before["preemptions"],
               ttft_s_median=float(np.median(ttft)) if ttft else None,
               host_ms_per_step=after["host_ms_per_step"], wait_ms_per_step=after["wait_ms_per_step"])
    if decode:
        step_s, roof_s = sum(dt for _, dt in decode), sum(cost(e) for e, _ in decode)
        rec.update(step_ms=1e3 * step_s / len(decode), roofline_ms=1e3 * roof_s / len(decode),
                   frac_of_roofline=roof_s / step_s)
    return rec


# -- report ------------------------------------------------------------------------------------
def table(records) -> str:
    head = ("| mode | batch | overlap | output tok/s | step ms | roofline ms | of roofline "
            "| compiles after warm-up |")
    rows = [head, "|" + "---|" * 8]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['mode']} | error: {r['error'][:60]} |||||||")
            continue
        rows.append(f"| {r['mode']} | {r['batch']:.1f} | {r.get('overlap', True)} | "
                    f"{r['output_tok_per_s']:.0f} | {r.get('step_ms', float('nan')):.2f} | "
                    f"{r.get('roofline_ms', float('nan')):.2f} | "
                    f"{r.get('frac_of_roofline', float('nan')):.0%} | "
                    f"{r['compilations_after_warmup']} |")
    return "\n".join(rows)


def save(records, out) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serving.json"), "w") as f:
        json.dump(records, f, indent=1)
    md = table(records)
    with open(os.path.join(out, "serving.md"), "w") as f:
        f.write(md + "\n")
    return md


def bench_offline(args):
    start = time.perf_counter()
    deadline = start + args.time_limit
    from pallasite.kernels import choose_impl
    from pallasite.model import config_from_dict, init_params
    model, mix = workload(args)
    if args.requests:
        mix["requests"] = args.requests
    env = dict(**run_info(), attention=choose_impl(), model="tiny" if args.tiny else "llama3-8b-shaped")
    print(json.dumps(env), flush=True)
    bw, how = copy_bandwidth(args.tiny)
    print(f"copy ceiling {bw / 1e12:.3f} TB/s ({how})", flush=True)
    config = config_from_dict(dict(model_type="llama", **model))
    params = jax.jit(lambda: init_params(config, args.seed, mix["dtype"]))()  # made on the device
    weights = bytes_read_per_step(params, config)
    per_token = kv_bytes_per_token(config, mix["dtype"])

    def cost(entry):  # a step's roofline, in seconds
        return (weights + per_token * entry["context_tokens"]) / bw

    engine = make_engine(config, params, args, mix)
    t = time.perf_counter()
    engine.warmup(workers=args.workers)
    warm = dict(warmup_s=time.perf_counter() - t, compilations=engine.compilations,
                buckets=[engine.token_buckets, engine.page_buckets], pages_total=engine.pages.num_pages,
                max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.scheduler.budget)
    print(json.dumps(warm), flush=True)
    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *a, **k: compiles.__setitem__(0, compiles[0] + (
            event == "/jax/core/compile/backend_compile_duration")))
    rng = np.random.default_rng(args.seed)
    records = []
    phases = [("batch1", lambda d: batch1(engine, mix, cost, rng, True, d)),
              ("batch1", lambda d: batch1(engine, mix, cost, rng, False, d)),
              ("offline", lambda d: offline(engine, mix, cost, rng, d))]
    for i, (mode, phase) in enumerate(phases):
        # Batch-1 phases get a short slice; the throughput run what is left, less a margin.
        left = deadline - time.perf_counter()
        share = deadline - 15 if mode == "offline" else time.perf_counter() + left / 8
        try:
            rec = phase(share)
        except Exception as e:  # report and go on: a benchmark should still leave its numbers
            rec = dict(mode=mode, error=f"{type(e).__name__}: {e}")
        rec.update(env, copy_tbps=bw / 1e12, copy_how=how, weight_bytes_read=weights,
                   compilations_after_warmup=compiles[0] + engine.compilations - warm["compilations"],
                   **{k: warm[k] for k in ("warmup_s", "max_num_seqs", "max_num_batched_tokens")})
        records.append(rec)
        print(json.dumps(rec), flush=True)
        md = save(records, args.out)  # after every phase: a cut-off run keeps what it measured
    print(f"\n{env['gpu']}, jax {env['jax_version']}, attention {env['attention']}, "
          f"copy {bw / 1e12:.2f} TB/s, warm-up {warm['warmup_s']:.0f} s "
          f"({warm['compilations']} compilations), total {time.perf_counter() - start:.0f} s")
    print(md)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--online" in argv:  # the online (server) benchmark lives in its own module
        from benchmarks import bench_online
        return bench_online.main([a for a in argv if a != "--online"])
    args = parse(argv)
    if args.tuning:
        from .common import override_tuning
        override_tuning(args.tuning)
    if args.sharegpt:
        return serving_sharegpt.main(args)
    if args.long_context:
        return serving_long.main(args)
    if not args.offline:
        sys.exit("choose a mode: --offline, --sharegpt offline|online, --long-context SHAPES "
                 "(or --online)")
    bench_offline(args)


if __name__ == "__main__":
    main()
