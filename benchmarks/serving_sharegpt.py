"""The ShareGPT modes of the serving benchmark: the engine on the 8B-shaped model (random bf16
weights) with the engine sizes it picks by itself, fed the committed ShareGPT lengths (prompts
of random token ids of each sampled length, outputs of exactly the sampled length: EOS ignored).

    python -m benchmarks.bench_serving --sharegpt offline --out DIR   # 1000 prompts at once
    python -m benchmarks.bench_serving --sharegpt online --out DIR    # Poisson arrivals

offline: every prompt submitted at once, paced as `LLM()` paces an offline batch on a GPU
(serving/scheduler.py; `--schedules` adds other limits and pacing, on the same compiled engine);
output and total tokens/s against the best published
single-H100 figure (16,215 output tok/s, SGLang, Llama 3.1 8B, 1000 prompts), and the run's floor:
the larger of its FLOPs at the dense bf16 peak and its longest output times the batch-1 step.
Every step is set against its budget (benchmarks/step_budget.py): pure decode and mixed steps by
batch size, `decode_frac_of_roofline_ge256` (decode steps of >= 256 rows), `prefill_mfu` (the
prefill tokens' FLOPs in mixed steps over the time those steps took beyond their decode rows'
roofline) and the host's time per step.

online: requests arrive as a Poisson process at each `--rates`, driven in this process (no
server: what is measured is the engine and its scheduling); TTFT and TPOT p50/p99 and goodput
(requests/s meeting TTFT <= 2 s and TPOT <= 50 ms) for the picked sizes and for the sizes the
engine used by default before (32 sequences, 512-token steps: the same compiled engine with the
scheduler's limits lowered), both in the same run.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import sharegpt, step_budget

BEST_PUBLISHED = 16215.0  # output tok/s, SGLang on one H100 (Llama 3.1 8B, 1000 ShareGPT prompts)
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.050
MODEL = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             rope_theta=500000.0)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
MAX_MODEL_LEN = sharegpt.MAX_TOTAL


# -- setup ---------------------------------------------------------------------------------------
def build(args):
    """The model, and an engine with the sizes and weights' layout `LLM()` would pick on this
    device (`--projections apart` keeps q/k/v and gate/up apart, to measure the fusion)."""
    from pallasite.model import config_from_dict, init_params, quant_int
    from pallasite.model.fuse import fuse_params
    from pallasite.serving.engine import Engine, min_token_bucket
    from pallasite.serving.llm import kv_cache_dtype_of
    from pallasite.serving.settings import default_pace, engine_sizes
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    config = config_from_dict(dict(model_type="llama", **(TINY if args.tiny else MODEL)))
    params = jax.jit(lambda: init_params(config, args.seed, dtype))()  # made on the device
    # the bf16 weights go once quantized: free memory sizes the KV pool
    params = quant_int.quantize_params(params, args.quantization)
    if args.projections == "fused":
        params = fuse_params(params)
    kv_dtype = kv_cache_dtype_of(args.kv_cache_dtype) or dtype
    sizes = engine_sizes(config, kv_dtype, max_model_len=MAX_MODEL_LEN, page_size=16,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         first_bucket=min_token_bucket(params))
    if args.tiny:  # a CPU dry run: a small engine
        sizes.update(num_pages=2048, max_num_seqs=64, max_num_batched_tokens=512,
                     token_buckets=[64, 512])
    engine = Engine(config, params, page_size=16, max_model_len=MAX_MODEL_LEN,
                    page_buckets=[16, MAX_MODEL_LEN // 16], kv_cache_dtype=kv_dtype,
                    pace=default_pace(params) if not args.tiny else 64, **sizes)
    return config, params, engine


def requests(pairs, vocab: int, seed: int, prefix: str):
    """Random token ids of each sampled prompt length (ids from 1000 up: no special tokens)."""
    rng = np.random.default_rng(seed)
    lo = min(1000, vocab // 2)
    return [(f"{prefix}{i}", rng.integers(lo, vocab, p).tolist(), o)
            for i, (p, o) in enumerate(pairs)]


def lengths(n: int, tiny: bool):
    pairs = sharegpt.load_lengths(n)
    if tiny:  # a CPU dry run: short requests
        pairs = [(max(4, p // 16), max(4, o // 16)) for p, o in pairs[:n]]
    return pairs


# -- offline -------------------------------------------------------------------------------------
def batch1_step_s(engine, vocab: int) -> float:
    """The median pure-decode step of one sequence (for the run's floor)."""
    from pallasite.serving.llm import SamplingParams
    engine.step_log = []
    engine.add_request("b1", [i % vocab for i in range(1000, 1256)],
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    log, engine.step_log = engine.step_log, None
    return float(np.median([dt for e, dt in step_times(log) if e["tokens"] == 1]))


def step_times(log):
    """Each step's time: from the previous step's results to its own (device-bound in steady
    state, since the next step is already queued)."""
    return [(b, b["done"] - a["done"]) for a, b in zip(log, log[1:])
            if "done" in a and "done" in b]


def trace_steps(engine, first: int, n: int):
    """Trace the host (`jax.profiler`) through steps [first, first + n) of the engine's next
    run. Returns a function to call after the run: it puts `Engine.step` back and returns the
    traced events by name, a step each (`dispatch.events_by_name`), or None if no step was
    traced."""
    import glob
    import tempfile
    from jax.profiler import ProfileData
    from .dispatch import events_by_name
    step, done, where = engine.step, [0], tempfile.TemporaryDirectory()

    def traced_step():
        if done[0] == first:
            jax.profiler.start_trace(where.name)
        out = step()
        done[0] += 1
        if done[0] == first + n:
            jax.profiler.stop_trace()
        return out

    def events():
        del engine.step  # the class's method again
        if done[0] <= first:
            return None
        if done[0] < first + n:  # the run ended inside the traced steps
            jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{where.name}/**/*.xplane.pb", recursive=True)[0])
        where.cleanup()
        return events_by_name(data, min(done[0], first + n) - first)
    engine.step = traced_step
    return events


def run_offline(engine, reqs, deadline):
    """`bench_serving.run` with the step log and host/device totals recorded."""
    from .bench_serving import run
    engine.step_log, engine.totals = [], dict(steps=0, host_s=0.0, wait_s=0.0)
    outs, wall = run(engine, reqs, deadline)
    log, engine.step_log = engine.step_log, None
    return outs, wall, log


def budget_report(cost, log, bw: float, peak: float) -> dict:
    """Every step against its budget: pure decode and mixed steps by batch size, the decode
    steps' fraction of roofline at >= 256 rows, and the prefill MFU of mixed steps."""
    timed = [(e, dt, step_budget.budget(cost, e, bw, peak)) for e, dt in step_times(log)]
    decode = [t for t in timed if t[0]["tokens"] == t[0]["decode_rows"]]
    mixed = [t for t in timed if t[0]["tokens"] > t[0]["decode_rows"]]
    big = [t for t in decode if t[0]["rows"] >= 256]
    decode_only = lambda e: step_budget.budget(cost, dict(
        tokens=e["decode_rows"], context_tokens=e["decode_context"],
        attended_tokens=e["decode_context"], sampled_rows=e["decode_rows"]), bw, peak)["roofline_s"]
    return dict(
        decode_by_batch=step_budget.by_batch(decode), mixed_by_batch=step_budget.by_batch(mixed),
        decode_frac_of_roofline_ge256=(sum(b["roofline_s"] for _, _, b in big)
                                       / sum(dt for _, dt, _ in big)) if big else None,
        prefill_mfu=step_budget.prefill_mfu(cost, [(e, dt, decode_only(e)) for e, dt, _ in mixed],
                                            peak),
        decode_steps=len(decode), mixed_steps=len(mixed),
        decode_time_s=sum(dt for _, dt, _ in decode), mixed_time_s=sum(dt for _, dt, _ in mixed))


def offline(engine, config, n: int, args, env, cost, bw, peak, b1_s, deadline, run=0) -> dict:
    """One offline run; `run` (the how-manieth on this engine) draws new prompt tokens, so no
    run finds an earlier one's prompts in the prefix cache."""
    pairs = lengths(n, args.tiny)
    reqs = requests(pairs, config.vocab_size, args.seed + run, f"off{n}-{run}-")
    if args.parts:  # the host time of each part of a step (`benchmarks/dispatch.py`)
        from .dispatch import instrument
        times, restore = instrument(engine)
    if args.host_trace:
        traced = trace_steps(engine, *args.host_trace)
    outs, wall, log = run_offline(engine, reqs, deadline)
    host = {}  # the host's parts and traced events, where asked for
    if args.host_trace:
        host["host_events"] = traced()
    if args.parts:
        restore()
        host.update(parts_us={p: dict(median=1e6 * float(np.median(v)),
                                       mean=1e6 * float(np.mean(v)),
                                       p90=1e6 * float(np.percentile(v, 90)))
                               for p, v in times.items() if v})
    if not log:
        raise SystemExit(f"offline, {n} prompts: the time limit came before the first step "
                         "(raise --time-limit)")
    out_tokens = sum(len(o.new_token_ids) for o in outs)
    done = {o.request_id for o in outs if o.finished and o.finish_reason == "length"}
    prompt_tokens = sum(p for p, _ in pairs)
    done_prompts = sum(len(prompt) for rid, prompt, _ in reqs if rid in done)
    flops = sum(step_budget.step_flops(cost, p + o, step_budget.attended_pairs(0, p + o), o)
                for p, o in pairs)
    floor_s = max(flops / peak, max(o for _, o in pairs) * b1_s)
    stats = engine.stats()
    rec = dict(mode="sharegpt_offline", prompts=n, completed=len(done), wall_s=wall,
               output_tok_per_s=out_tokens / wall,
               total_tok_per_s=(out_tokens + done_prompts) / wall,
               vs_best_published=out_tokens / wall / BEST_PUBLISHED,
               best_published_output_tok_per_s=BEST_PUBLISHED,
               floor_s=floor_s, floor_output_tok_per_s=sum(o for _, o in pairs) / floor_s,
               frac_of_floor=floor_s / wall, batch1_step_ms=1e3 * b1_s,
               mean_prompt=prompt_tokens / n, mean_output=sum(o for _, o in pairs) / n,
               steps=len(log), mean_rows=float(np.mean([e["rows"] for e in log])),
               max_running=max(e["running"] for e in log),
               kv_occupancy_max=max(e["pages_used"] for e in log) / engine.pages.num_pages,
               preemptions=stats["preemptions"],
               host_ms_per_step=stats["host_ms_per_step"],
               wait_ms_per_step=stats["wait_ms_per_step"], **budget_report(cost, log, bw, peak),
               **host)
    rec = {**env, **rec}
    engine.scheduler.num_preemptions = 0
    return rec


# -- online --------------------------------------------------------------------------------------
def run_online(engine, reqs, rate: float, rng, deadline) -> dict:
    """Poisson arrivals at `rate`/s; per request its arrival, first and last token times."""
    from pallasite.serving.llm import SamplingParams
    sp = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    arrive = np.cumsum(rng.exponential(1 / rate, len(reqs)))
    seen = {rid: [None, None, 0, p, n] for rid, p, n in ((r[0], len(r[1]), r[2]) for r in reqs)}
    t0, i = time.perf_counter(), 0
    while (i < len(reqs) or engine.has_unfinished()) and time.perf_counter() < deadline:
        now = time.perf_counter() - t0
        while i < len(reqs) and arrive[i] <= now:
            rid, prompt, n = reqs[i]
            engine.add_request(rid, prompt, sp(n))
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrive[i] - now, 0.01)) if i < len(reqs) else 0)
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            s = seen[o.request_id]
            if o.new_token_ids and s[0] is None:
                s[0] = now
            s[1], s[2] = now, s[2] + len(o.new_token_ids)
    wall = time.perf_counter() - t0
    for rid in list(engine.seqs):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    ttft, tpot, good, out_tokens, done = [], [], 0, 0, 0
    for k, (rid, (first, last, got, p, n)) in enumerate(seen.items()):
        if k >= i or got < n:
            continue
        done += 1
        out_tokens += got
        ttft.append(first - arrive[k])
        tpot.append((last - first) / (got - 1) if got > 1 else 0.0)
        good += ttft[-1] <= SLO_TTFT_S and tpot[-1] <= SLO_TPOT_S
    pct = lambda name, v: {f"{name}_p{q}": 1e3 * float(np.percentile(v, q)) if v else None
                           for q in (50, 99)}
    rec = dict(rate=rate, requests=len(reqs), completed=done, wall_s=wall,
               output_tok_per_s=out_tokens / wall, goodput_req_per_s=good / wall,
               **pct("ttft_ms", ttft), **pct("tpot_ms", tpot))
    rec["slo_met"] = bool(ttft) and rec["ttft_ms_p99"] <= 1e3 * SLO_TTFT_S and \
        rec["tpot_ms_p99"] <= 1e3 * SLO_TPOT_S
    return rec


def online(engine, config, args, env, deadline) -> list[dict]:
    """Each rate with the picked sizes and with the old defaults (the scheduler's limits
    lowered on the same engine), alternating so both see the same machine state."""
    pairs = lengths(args.online_prompts, args.tiny)
    sched = engine.scheduler
    picked = (sched.max_num_seqs, sched.budget)
    settings = [("picked", picked), ("old_defaults", (32, 512))]
    records = []
    for rate in args.rates:
        for name, (seqs, budget) in settings:
            left = deadline - time.perf_counter()
            if left < 20:
                break
            sched.max_num_seqs, sched.budget = seqs, budget
            reqs = requests(pairs, config.vocab_size, args.seed + int(rate * 10), f"{name}{rate}-")
            rec = run_online(engine, reqs, rate, np.random.default_rng(args.seed),
                             time.perf_counter() + min(left - 10, args.online_limit))
            rec = {**env, **rec, **dict(
                mode="sharegpt_online", settings=name, max_num_seqs=seqs,
                max_num_batched_tokens=budget, prompts=len(reqs),
                slo=f"p99 TTFT <= {SLO_TTFT_S:g} s, p99 TPOT <= {1e3 * SLO_TPOT_S:g} ms")}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    sched.max_num_seqs, sched.budget = picked
    for name, _ in settings:  # goodput: the highest rate whose p99s meet the SLO
        met = [r["rate"] for r in records if r["settings"] == name and r["slo_met"]]
        for r in records:
            if r["settings"] == name:
                r["goodput_rate"] = max(met) if met else 0.0
    return records


# -- the run -------------------------------------------------------------------------------------
def main(args):
    start = time.perf_counter()
    deadline = start + args.time_limit
    from pallasite.kernels import choose_impl
    from pallasite.model import quant
    from .common import copy_bandwidth, run_info
    env = dict(**run_info(), attention=choose_impl(),
               model="tiny" if args.tiny else "llama3-8b-shaped",
               lengths="benchmarks/data/sharegpt_lengths_N.json", tokenizer=sharegpt.TOKENIZER,
               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
               projections=args.projections)
    print(json.dumps(env), flush=True)
    pairs = lengths(max(args.prompts + [args.online_prompts]), args.tiny)  # fail early if absent
    bw, how = copy_bandwidth(gb=0.05 if args.tiny else 4)
    peak = step_budget.peak_bf16(env["gpu"]) or (1e12 if args.tiny else None)
    if peak is None:
        raise SystemExit(f"no dense bf16 peak known for {env['gpu']!r}: add it to "
                         "benchmarks/step_budget.py PEAK_BF16")
    config, params, engine = build(args)
    body, rate = step_budget.QUANTIZED_BODY.get(args.quantization, (None, 1.0))
    cost = step_budget.model_cost(config, itemsize=2 if not args.tiny else 4,
                                  kv_itemsize=1 if args.kv_cache_dtype == "fp8" else None,
                                  body_itemsize=body, body_rate=rate)
    t = time.perf_counter()
    engine.warmup(workers=args.workers)
    warm = dict(warmup_s=time.perf_counter() - t, compilations=engine.compilations,
                max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.scheduler.budget,
                pages_total=engine.pages.num_pages, token_buckets=engine.token_buckets,
                copy_tbps=bw / 1e12, copy_how=how, peak_tflops=peak / 1e12,
                # what the weights and the KV pool hold on the device (quantized: as stored)
                weight_bytes=quant.weight_bytes(engine.params),
                kv_pool_bytes=sum(x.nbytes for x in jax.tree.leaves(engine.state[0])))
    print(json.dumps(warm), flush=True)
    env.update(warm)
    records = []
    if args.sharegpt == "offline":
        b1 = batch1_step_s(engine, config.vocab_size)
        sched = engine.scheduler
        picked = (sched.max_num_seqs, sched.budget, sched.pace or 0)
        swept = [(s, b, picked[2] if p < 0 else p) for s, b, p in args.schedules or []]
        for seqs, budget, pace in [picked] + [s for s in swept if s != picked]:
            if seqs > picked[0] or budget > picked[1] or seqs > budget:
                raise SystemExit(f"--schedules {seqs}:{budget}: at most the compiled "
                                 f"{picked[0]}:{picked[1]}, and sequences <= tokens")
            sched.max_num_seqs, sched.budget, sched.pace = seqs, budget, pace or None
            for n in args.prompts:
                if deadline - time.perf_counter() < 30:
                    break
                rec = offline(engine, config, n, args, env, cost, bw, peak, b1, deadline - 10,
                              run=len(records))
                rec.update(settings="picked" if (seqs, budget, pace) == picked else "swept",
                           max_num_seqs=seqs, max_num_batched_tokens=budget, pace=pace or None)
                records.append(rec)
                print(json.dumps(rec), flush=True)
                save(records, args.out)
        sched.max_num_seqs, sched.budget, sched.pace = picked[0], picked[1], picked[2] or None
    else:
        engine.scheduler.pace = None  # as `pallasite serve` runs: no pacing online
        records = online(engine, config, args, env, deadline)
        save(records, args.out)
    print(f"\ntotal {time.perf_counter() - start:.0f} s (warm-up {warm['warmup_s']:.0f} s, "
          f"{warm['compilations']} compilations); {len(pairs)} ShareGPT pairs")
    print(table(records))
    return records


def save(records, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serving_sharegpt.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(out, "serving_sharegpt.md"), "w") as f:
        f.write(table(records) + "\n")


def table(records) -> str:
    lines = []
    for r in records:
        if r["mode"] == "sharegpt_offline":
            lines += [f"offline, {r['prompts']} prompts, {r.get('max_num_seqs')} sequences / "
                      f"{r.get('max_num_batched_tokens')} tokens a step, paced at "
                      f"{r.get('pace') or 'none'}: "
                      f"{r['output_tok_per_s']:.0f} output tok/s "
                      f"({r['total_tok_per_s']:.0f} total), {r['vs_best_published']:.2f}x the best "
                      f"published; floor {r['floor_output_tok_per_s']:.0f} tok/s; decode >= 256 "
                      f"rows at {_pct(r['decode_frac_of_roofline_ge256'])} of roofline; prefill "
                      f"MFU {_pct(r['prefill_mfu'])}; host {r['host_ms_per_step']:.2f} ms/step",
                      "| step | rows | steps | step ms | memory ms | compute ms | roofline ms "
                      "| of roofline | host ms | wait ms |", "|" + "---|" * 10]
            for kind in ("decode", "mixed"):
                for g in r[f"{kind}_by_batch"]:
                    lines.append(f"| {kind} | {g['rows']} | {g['steps']} | {g['step_ms']:.2f} | "
                                 f"{g['memory_ms']:.2f} | {g['compute_ms']:.2f} | "
                                 f"{g['roofline_ms']:.2f} | {g['frac_of_roofline']:.0%} | "
                                 f"{g.get('host_ms', float('nan')):.2f} | "
                                 f"{g.get('wait_ms', float('nan')):.2f} |")
            for e in (r.get("host_events") or [])[:25]:
                lines.append(f"    {e['us_per_step']:9.1f} us {e['calls_per_step']:7.1f} calls  "
                             f"{e['name']}")
            if "parts_us" in r:
                lines.append("host us a step, median / mean: " + ", ".join(
                    f"{p} {v['median']:.0f} / {v['mean']:.0f}" for p, v in r["parts_us"].items()))
            lines.append("")
    online_rows = [r for r in records if r["mode"] == "sharegpt_online"]
    if online_rows:
        lines += ["| settings | rate/s | done | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
                  "| goodput req/s | SLO met |", "|" + "---|" * 8]
        for r in online_rows:
            f = lambda a, b: "-" if r[a] is None else f"{r[a]:.0f} / {r[b]:.0f}"
            lines.append(f"| {r['settings']} ({r['max_num_seqs']}/{r['max_num_batched_tokens']}) "
                         f"| {r['rate']:g} | {r['completed']}/{r['requests']} | "
                         f"{r['output_tok_per_s']:.0f} | {f('ttft_ms_p50', 'ttft_ms_p99')} | "
                         f"{f('tpot_ms_p50', 'tpot_ms_p99')} | {r['goodput_req_per_s']:.2f} | "
                         f"{r['slo_met']} |")
    return "\n".join(lines)


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def _schedules(s):
    """SEQS:TOKENS[:PACE],... (PACE 0: unpaced; left out, -1: the picked pacing)."""
    out = [tuple(int(v) for v in x.split(":")) for x in s.split(",")]
    return [x if len(x) == 3 else (*x, -1) for x in out]


def add_arguments(ap):
    ap.add_argument("--quantization", default=None, help="fp8, w4a16 or w8a16 weights")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the weights') or fp8")
    ap.add_argument("--projections", choices=["fused", "apart"], default="fused",
                    help="q/k/v and gate/up weights fused (as LLM() holds them on one device) "
                         "or apart")
    ap.add_argument("--sharegpt", choices=["offline", "online"], default=None,
                    help="the ShareGPT workload (see benchmarks/serving_sharegpt.py)")
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[1000],
                    help="offline: prompt counts, one run each (1000, 2000)")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                    default=[8.0, 16.0, 32.0, 64.0], help="online: arrivals per second")
    ap.add_argument("--online-prompts", type=int, default=300, help="online: requests per rate")
    ap.add_argument("--online-limit", type=float, default=60, help="online: seconds per rate")
    ap.add_argument("--parts", action="store_true",
                    help="offline: also time each part of a step on the host (schedule, pack, "
                         "the programs' launches, accept)")
    ap.add_argument("--host-trace", type=lambda s: tuple(int(x) for x in s.split(":")),
                    default=None, metavar="FIRST:N",
                    help="offline: trace the host through N steps of each run from step FIRST, "
                         "and list its events by name (PJRT, CUDA graph updates and launches)")
    ap.add_argument("--schedules", type=_schedules, default=None,
                    help="offline: also run the workload with these scheduler limits on the same "
                         "compiled engine, SEQS:TOKENS[:PACE][,...] (e.g. 512:8192,1024:8192:0; "
                         "PACE 0: unpaced)")
