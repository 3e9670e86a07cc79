"""Where the time of a serving decode step goes, on a Llama-3-8B-shaped model (random bf16
weights made on the device):

    python -m profiling.profile_step --out $OUT              # GPU, at most --time-limit (230 s)
    python -m profiling.profile_step --tiny --out /tmp/prof  # a tiny model on CPU: a dry run

The step is the engine's own: the forward executable and the greedy sampler that
`serving.engine.Engine` compiles and calls, fed a synthetic decode batch laid out by the
engine's `int_layout` (batch 1 at context 512, batch 64 at context 1024). For each batch:

- step time: the median of steps each read back before the next (`synced`) and the mean of
  steps dispatched back to back (`pipelined`, what the engine's one-step-ahead overlap can
  reach); batch 1 also through `Engine.step()` itself, prefill included (`Engine.step()`);
- from a `jax.profiler` trace of a few pipelined steps: device ops per step, their summed time
  against the pipelined step time (the difference is the device sitting idle: launch and host
  overhead), time per category (matrix products, logits, attention kernel, split-K merge,
  attention glue, KV write, norm/RoPE/elementwise fusions, sampler, copies, other) and the top
  kernels. Kernels are matched to the compiled HLO (op name, fused ops, JAX op_name) to be
  categorized. XLA turns its command buffers (CUDA graphs) off under a profiler, so the step is
  traced again compiled with them kept: that timeline shows the launch gaps as served.

Then each XLA_FLAGS variant in `VARIANTS` runs in its own process (flags are read when JAX
starts; a bad flag aborts only that process and is reported), in order, as long as the time
limit allows; `--variants a,b` picks some. Writes OUT/profile_step.json (everything),
OUT/<variant>.log, the traces (open them in ui.perfetto.dev) under OUT/traces/, and prints the
tables last.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from .step_engine import (cases, compile_all, engine_loop, make_engine, make_step, random_params,
                          step_bytes, step_inputs, time_steps, trace_steps, workload)
from .step_trace import breakdown, device_ops, parse_hlo

# Flag names and values checked against XLA's debug_options_flags.cc and xla.proto of the JAX
# 0.10-0.11 era (and parsed by this machine's jaxlib). In that era XLA already records FUSION,
# CUBLAS, CUBLASLT, CUDNN, CUSTOM_CALL, DYNAMIC_SLICE_FUSION and CONDITIONAL into CUDA graphs of
# at least 5 commands; WHILE is off (the attention's block metadata has a searchsorted, a while
# loop), and a custom call joins a graph only if its FFI handler says it may.
CMD_ALL = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,"
           "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE")
MIN1 = "--xla_gpu_graph_min_graph_size=1"
VARIANTS = [  # (name, XLA_FLAGS added), most telling first: a short time limit cuts the tail
    ("default", ""),
    ("graphs_all_min1", f"{CMD_ALL} {MIN1}"),
    ("graphs_off", "--xla_gpu_enable_command_buffer="),
    ("triton_gemm_off", "--xla_gpu_enable_triton_gemm=false"),  # matrix-vector products: cuBLAS
    ("dot_merger_off", "--xla_gpu_dot_merger_threshold_mb=0"),  # no runtime concat of weights
    # every product a Triton fusion candidate, its elementwise neighbours fused in (SwiGLU into
    # the down product's operand); with PALLASITE_TRITON_GEMM=1 for the large steps too
    ("triton_any", "--xla_gpu_triton_gemm_any=true"),
    ("graphs_all_min1_concurrent", f"{CMD_ALL} {MIN1} "
                                   "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"),
    ("graphs_all", CMD_ALL),
    ("graphs_all_min1_unroll", f"{CMD_ALL} {MIN1} --xla_gpu_command_buffer_unroll_loops=true"),
    ("graphs_all_min1_no_update", f"{CMD_ALL} {MIN1} "
                                  "--xla_gpu_command_buffer_update_mode=NEVER_UPDATE"),
]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (a dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--time-limit", type=float, default=230, help="seconds for the whole run")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names from VARIANTS (default: all, in order)")
    ap.add_argument("--trace-steps", type=int, default=5)
    ap.add_argument("--cases", default="b1,b64",
                    help="steps to profile, of b1, b64, b768 (768 decode rows at context 320) "
                         "and mixed (8192 tokens: 30 prefill chunks of 256 + 512 decode rows), "
                         "paced (a paced offline step: 200 decode rows + a 56-token chunk), "
                         "tail (one of its last: a 247-token chunk at keys 400-647 + 9 decode "
                         "rows), "
                         "b8x8k and b32x2k (8 rows at context 8192, 32 at 2048), p2k (a "
                         "2048-token prompt in one step)")
    ap.add_argument("--quantization", default=None, help="fp8, w4a16 or w8a16 weights")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the weights') or fp8")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one variant here
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- the parent: one process per variant -------------------------------------------------------
def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    start = time.time()
    deadline = start + args.time_limit - 5  # a margin for the report
    os.makedirs(args.out, exist_ok=True)
    names = args.variants.split(",") if args.variants else [n for n, _ in VARIANTS]
    unknown = set(names) - {n for n, _ in VARIANTS}
    if unknown:
        sys.exit(f"unknown variants {sorted(unknown)}; known: {[n for n, _ in VARIANTS]}")
    results = []
    for name, flags in VARIANTS:
        if name not in names:
            continue
        need = (15 if args.tiny else 45) * (2 if name == "default" else 1)
        if deadline - time.time() < need:
            results.append(dict(variant=name, flags=flags, status="skipped: out of time"))
        else:
            results.append(run_child(args, name, flags, deadline))
        print(f"[{time.time() - start:5.0f} s] {name}: {results[-1]['status']}", flush=True)
        save(args.out, results)
    print(report(results))
    print(f"total {time.time() - start:.0f} s; everything in "
          f"{os.path.join(args.out, 'profile_step.json')}")


def run_child(args, name, flags, deadline):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "profiling.profile_step", "--child", name, "--out", args.out,
           "--deadline", str(deadline), "--trace-steps", str(args.trace_steps),
           "--cases", args.cases, "--kv-cache-dtype", args.kv_cache_dtype]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--quantization", args.quantization] if args.quantization else []
    log = os.path.join(args.out, f"{name}.log")
    result_file = os.path.join(args.out, f"{name}.json")
    if os.path.exists(result_file):
        os.remove(result_file)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()  # the child we started, by its handle
            proc.wait()
            rc = "timeout"
    out = dict(variant=name, flags=flags)
    if os.path.exists(result_file):
        with open(result_file) as f:
            out.update(json.load(f))
    out["status"] = "ok" if rc == 0 and "cases" in out else f"failed ({rc}): {last_error(log)}"
    return out


def last_error(log: str) -> str:
    """The line of a failed child's log that says why (XLA's flag errors, a Python error)."""
    with open(log, errors="replace") as f:
        lines = [l.strip() for l in f if l.strip()]
    keys = ("Unknown flag", "Illegal value", "Check failed", "Error", "error", "Killed")
    hits = [l for l in lines if any(k in l for k in keys)]
    return ((hits or lines or ["no output"])[-1])[:200]


def save(out, results):
    with open(os.path.join(out, "profile_step.json"), "w") as f:
        json.dump(results, f, indent=1)


# -- the child: build the engine's step and measure it -----------------------------------------
def child(args):
    import jax
    import jax.numpy as jnp
    from benchmarks.common import run_info
    from pallasite.kernels import choose_impl
    from pallasite.model import config_from_dict, quant_int
    start, full = time.time(), args.child == "default"
    deadline = args.deadline or start + 1e9
    model, w = workload(args.tiny)
    res = dict(env=dict(variant=args.child, xla_flags=os.environ.get("XLA_FLAGS", ""),
                        device=jax.devices()[0].device_kind, **run_info(),
                        attention=choose_impl(), model="tiny" if args.tiny else "llama3-8b-shaped",
                        layers=model["num_hidden_layers"], quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype))
    print(json.dumps(res["env"]), flush=True)
    if full:  # before the weights and pages take the memory
        from benchmarks.common import copy_bandwidth
        bw, how = copy_bandwidth(gb=0.05 if args.tiny else 4)
        res.update(copy_tbps=bw / 1e12, copy_how=how)
    config = config_from_dict(dict(model_type="llama", **model))
    params = random_params(config, jnp.dtype(w["dtype"]))
    params = quant_int.quantize_params(params, args.quantization)
    from pallasite.serving.engine import min_token_bucket
    specs = cases(w, args.cases.split(","), min_token_bucket(params))
    from pallasite.serving.llm import kv_cache_dtype_of
    engine = make_engine(config, params, w, specs, kv_cache_dtype_of(args.kv_cache_dtype))
    t = time.time()
    b1 = full and "b1" in specs
    prefill_key = (w["b1"][1], specs["b1"][1][1]) if b1 else None  # for Engine.step()
    graph_exes = compile_all(engine, [s[1] for s in specs.values()], prefill_key, keep_graphs=full)
    res["compile_s"] = time.time() - t
    print(f"compiled in {res['compile_s']:.0f} s", flush=True)
    res["cases"] = {}
    for name, spec in specs.items():
        if time.time() > deadline - (10 if args.tiny else 20):
            break
        res["cases"][name] = profile_case(engine, config, name, spec, graph_exes, args, w,
                                          res.get("copy_tbps"), deadline)
        print(json.dumps({name: summary(res["cases"][name])}), flush=True)
        write_json(args.out, args.child, res)
    if full and "b1" in res["cases"] and time.time() < deadline - (5 if args.tiny else 15):
        res["cases"]["b1"].update(engine_loop(engine, w["b1"][1], w["gen"]))
        print(f"engine loop: {res['cases']['b1']['engine_ms']:.3f} ms/step", flush=True)
    res["child_s"] = time.time() - start
    write_json(args.out, args.child, res)


def write_json(out, name, res):
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)


def profile_case(engine, config, name, spec, graph_exes, args, w, copy_tbps, deadline):
    """Time one step; in the default variant also trace it, with graphs off (as XLA runs under
    a profiler) and, where that compiled, with command buffers kept."""
    import jax
    from benchmarks.step_budget import peak_bf16
    seqs, key, first_page = spec
    inputs = step_inputs(engine, seqs, key, first_page)
    step = make_step(engine, key, inputs)
    tokens = sum(q for q, _ in seqs)
    case = dict(batch=len(seqs), tokens=tokens, context=max(c for _, c in seqs), bucket=list(key),
                **time_steps(step, *w["steps"]))
    case["bytes"] = step_bytes(engine.params, config, sum(c for _, c in seqs),
                               engine.kv_cache_dtype)
    peak = peak_bf16(jax.devices()[0].device_kind)
    if copy_tbps and peak:  # the larger of reading the bytes and the weights' FLOPs at peak
        flops = 2 * tokens * case["bytes"]["layer_weights"] / engine.params["embed"].itemsize
        case["roofline_ms"] = 1e3 * max(case["bytes"]["total"] / copy_tbps / 1e12, flops / peak)
    if args.child != "default" or time.time() > deadline - (10 if args.tiny else 25):
        return case
    case["trace"] = trace_case(engine, key, step, engine._exe[key], case, args, name, "trace")
    if key in graph_exes:
        graphs = make_step(engine, key, inputs, graph_exes[key])
        case["trace_graphs"] = trace_case(engine, key, graphs, graph_exes[key], case, args, name,
                                          "trace_graphs")
    return case


def trace_case(engine, key, step, exe, case, args, name, kind) -> dict:
    try:
        path = trace_steps(step, args.trace_steps, os.path.join(args.out, "traces",
                                                                f"{name}_{kind}"))
        sampler = engine._samplers[(min(key[0], engine.max_num_seqs), "greedy")]
        modules = [parse_hlo(exe.as_text(), "forward"), parse_hlo(sampler.as_text(), "sampler")]
        out = breakdown(device_ops(path), modules, args.trace_steps,
                        engine.config.vocab_size, case["pipelined_ms"])
        out["file"] = os.path.relpath(path, args.out)
        add_bandwidths(out, case["bytes"])
        for other in glob.glob(os.path.join(os.path.dirname(path), "*")):
            if other != path:  # the same events again (xplane, trace.json): keep OUT small
                os.remove(other)
        return out
    except Exception as e:  # the timings still count
        return dict(error=f"{type(e).__name__}: {e}")


def add_bandwidths(b, need):
    """Bytes each kind of kernel must read over the time it took (TB/s)."""
    cats = b["categories"]
    b["tbps"] = {}
    for what, nbytes, cat in (("matmul", need["layer_weights"], "matmul"),
                              ("lm_head", need["lm_head"], "logits/lm_head"),
                              ("attention", need["kv"], "attention kernel")):
        ms = cats.get(cat, {}).get("ms", 0.0)
        b["tbps"][what] = nbytes / ms / 1e9 if ms else None


def summary(case) -> dict:
    keys = ("synced_ms", "pipelined_ms", "engine_ms", "roofline_ms")
    out = {k: round(case[k], 3) for k in keys if k in case}
    for kind in ("trace", "trace_graphs"):
        t = case.get(kind, {})
        if "ops_per_step" in t:
            out[kind] = dict(ops=t["ops_per_step"], kernel_ms=round(t["kernel_ms"], 3),
                              idle_ms=round(t["idle_ms"], 3))
    return out


# -- the report --------------------------------------------------------------------------------
def report(results) -> str:
    out = []
    default = next((r for r in results if r["variant"] == "default" and "cases" in r), None)
    for name, case in (default or {}).get("cases", {}).items():
        out += case_report(name, case, default)
    out += ["", "XLA_FLAGS variants (step ms; synced = read back every step, pipelined = "
                "dispatched back to back):",
            f"{'variant':30s} {'b1 sync':>8s} {'b1 pipe':>8s} {'b64 sync':>9s} {'b64 pipe':>9s}"
            "  status"]
    for r in results:
        c = r.get("cases", {})
        cell = lambda n, k, w: f"{c[n][k]:{w}.3f}" if n in c and k in c[n] else f"{'-':>{w}s}"
        out.append(f"{r['variant']:30s} {cell('b1', 'synced_ms', 8)} "
                   f"{cell('b1', 'pipelined_ms', 8)} {cell('b64', 'synced_ms', 9)} "
                   f"{cell('b64', 'pipelined_ms', 9)}  {r.get('status', 'ok')}")
    return "\n".join(out)


def case_report(name, case, res) -> list[str]:
    env = res["env"]
    head = (f"== {name}: {case['batch']} sequences, {case.get('tokens', case['batch'])} tokens, "
            f"context up to {case['context']}, bucket T,P = "
            f"{tuple(case['bucket'])}; {env['device']}, JAX {env['jax_version']}, "
            f"attention {env['attention']} ==")
    times = [f"synced {case['synced_ms']:.3f}", f"pipelined {case['pipelined_ms']:.3f}"]
    if "engine_ms" in case:
        times.append(f"Engine.step() {case['engine_ms']:.3f}")
    if "roofline_ms" in case:
        times.append(f"roofline {case['roofline_ms']:.3f} "
                     f"({case['roofline_ms'] / case['pipelined_ms']:.0%} of pipelined)")
    out = ["", head, "step ms: " + ", ".join(times)]
    for kind, what in (("trace", "trace (graphs off, as XLA runs under a profiler)"),
                       ("trace_graphs", "trace with command buffers kept")):
        t = case.get(kind)
        if not t:
            continue
        if "error" in t:
            out.append(f"{what}: {t['error'][:150]}")
            continue
        out.append(f"{what}: {t['ops_per_step']:.0f} device ops/step "
                   f"({t['ops_per_step'] / env['layers']:.1f} per layer), kernel sum "
                   f"{t['kernel_ms']:.3f} ms, busy {t['busy_ms']:.3f} ms, idle in the pipelined "
                   f"step {t['idle_ms']:.3f} ms; traced span {t['span_ms']:.3f} ms, median gap "
                   f"{t['gap_us']['median']:.1f} us; unmatched ops/step "
                   f"{t['unmatched_per_step']:.0f}")
    t, g = case.get("trace"), case.get("trace_graphs", {}).get("categories", {})
    if t and "categories" in t:
        out.append(f"{'category':24s} {'calls/step':>10s} {'ms/step':>8s} {'share':>6s} "
                   f"{'gap ms before, graphs off/kept':>31s}")
        for c, v in sorted(t["categories"].items(), key=lambda kv: -kv[1]["ms"]):
            kept = f"{g[c]['gap_ms']:.3f}" if c in g else "-"
            out.append(f"{c:24s} {v['calls']:10.1f} {v['ms']:8.3f} {v['share']:6.0%} "
                       f"{v['gap_ms']:17.3f} / {kept}")
        tb = {k: v for k, v in t.get("tbps", {}).items() if v}
        out.append("bytes / kernel time (TB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in tb.items())
                   + (f"; copy ceiling {res['copy_tbps']:.2f}" if res.get("copy_tbps") else ""))
        out.append(f"top kernels: {'calls/step':>10s} {'ms/step':>8s}  category | kernel | op")
        for g in t["top"]:
            out.append(f"  {g['calls']:21.1f} {g['ms']:8.3f}  {g['category']} | {g['kernel']}")
    return out


if __name__ == "__main__":
    main()
