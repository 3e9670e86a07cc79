"""Where the time of a serving decode step goes, on a Llama-3-8B-shaped model (random bf16
weights made on the device):

    python -m profiling.profile_step --out $OUT                # GPU, at most --time-limit (230 s)
    python -m profiling.profile_step --tiny --out /tmp/prof    # a tiny model on CPU: checks the script

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
import gzip
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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
    ("graphs_all_min1_concurrent", f"{CMD_ALL} {MIN1} "
                                   "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"),
    ("graphs_all", CMD_ALL),
    ("graphs_all_min1_unroll", f"{CMD_ALL} {MIN1} --xla_gpu_command_buffer_unroll_loops=true"),
    ("graphs_all_min1_no_update", f"{CMD_ALL} {MIN1} "
                                  "--xla_gpu_command_buffer_update_mode=NEVER_UPDATE"),
]
KEEP_GRAPHS = {"xla_enable_command_buffers_during_profiling": True}  # a compile option
PAGE = 16  # tokens per KV page, as the engine and the benchmarks use
CATEGORIES = ["matmul", "logits/lm_head", "attention kernel", "split-K merge", "attention glue",
              "KV write", "norm/RoPE/elementwise", "sampler", "copy/memset", "other"]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (a dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--time-limit", type=float, default=230, help="seconds for the whole run")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names from VARIANTS (default: all, in order)")
    ap.add_argument("--trace-steps", type=int, default=5)
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
           "--deadline", str(deadline), "--trace-steps", str(args.trace_steps)]
    cmd += ["--tiny"] if args.tiny else []
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
def workload(tiny: bool):
    """Model shape and the two decode batches (batch, context)."""
    if tiny:
        model = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return model, dict(b1=(1, 32), b64=(4, 64), gen=16, steps=(10, 20), dtype="float32")
    model = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0)
    return model, dict(b1=(1, 512), b64=(64, 1024), gen=256, steps=(30, 60), dtype="bfloat16")


def random_params(config, dtype, seed=0):
    """normal(0.02) matrices and unit norm scales, made on the device one leaf at a time (one
    small compile per distinct shape instead of tracing the whole model's init)."""
    import jax
    import jax.numpy as jnp
    from pallasite.model import param_shapes
    leaves, tree = jax.tree.flatten(param_shapes(config, dtype))
    makers = {}

    def maker(shape):
        if shape not in makers:
            makers[shape] = jax.jit(lambda s: (0.02 * jax.random.normal(
                jax.random.key(s), shape, jnp.float32)).astype(dtype))
        return makers[shape]

    out = [maker(x.shape)(seed + i) if x.ndim > 1 else jnp.ones(x.shape, dtype)
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(tree, out)


def cases(w):
    """name -> (batch, context, (T, P) bucket, first page of its page runs). Page tables are as
    wide as the context plus `gen` tokens (the batch-1 one as in benchmarks/bench_serving.py)."""
    from pallasite.serving.engine import MIN_TOKEN_BUCKET
    (b1, ctx1), (b2, ctx2), ps = w["b1"], w["b64"], PAGE
    p1, p2 = -(-(ctx1 + w["gen"]) // ps), -(-(ctx2 + w["gen"]) // ps)
    t1 = max(b1, MIN_TOKEN_BUCKET)  # the engine pads a lone token to its smallest bucket
    return {"b1": (b1, ctx1, (t1, p1), 1), "b64": (b2, ctx2, (b2, p2), 1 + p1)}


def make_engine(config, params, w):
    """An engine whose buckets hold both decode batches and a one-step prefill of the batch-1
    prompt (for the `Engine.step()` run)."""
    from pallasite.serving.engine import Engine
    (b1, ctx1, (_, p1), _), (b2, ctx2, (_, p2), _) = cases(w).values()
    return Engine(config, params, num_pages=1 + p1 + b2 * p2 + 8, page_size=PAGE,
                  max_num_seqs=b2, max_num_batched_tokens=ctx1, max_model_len=ctx2 + w["gen"],
                  token_buckets=[b1, b2, ctx1], page_buckets=[p1, p2])


def compile_all(engine, keys, prefill_key, keep_graphs: bool):
    """Compile (in threads, as `Engine.warmup` does) the decode steps, the prefill step if any
    and the greedy samplers into the engine's own tables, plus each decode step once more with
    command buffers kept under the profiler if asked. Returns {key: that second executable}."""
    keys = keys + ([prefill_key] if prefill_key else [])
    samplers = sorted({(min(T, engine.max_num_seqs), "greedy") for T, _ in keys})
    lowered = {k: engine._lower(k) for k in keys}
    jobs = [(("fwd", k), lo, None) for k, lo in lowered.items()]
    jobs += [(("smp", s), engine._lower_sampler(*s), None) for s in samplers]
    # Lowered again, not shared: two threads compiling one lowering would share its IR.
    jobs += [(("graphs", k), engine._lower(k), KEEP_GRAPHS) for k in keys if keep_graphs
             and k != prefill_key]

    def compile_one(job):
        try:
            return job[1].compile(job[2]) if job[2] else job[1].compile()
        except Exception as e:  # only the optional graph-keeping compile may fail
            if job[0][0] != "graphs":
                raise
            print(f"compile with {job[2]} failed: {e}", flush=True)
            return None

    with ThreadPoolExecutor(min(8, len(jobs))) as pool:
        done = list(pool.map(compile_one, jobs))
    graphs = {}
    for (kind, key), exe in zip([j[0] for j in jobs], done):
        {"fwd": engine._exe, "smp": engine._samplers, "graphs": graphs}[kind][key] = exe
    engine.compilations += len(jobs)
    return {k: v for k, v in graphs.items() if v is not None}


def decode_inputs(engine, batch: int, ctx: int, key, first_page: int, seed=0):
    """The packed int32 inputs of one decode step, laid out by the engine's `int_layout`: `batch`
    sequences at context `ctx`, each on its own run of pages, its newest token read from the
    device's `last_tokens` (as when the previous step's sample is not on the host yet)."""
    from pallasite.serving import sampling
    from pallasite.serving.engine import int_layout
    T, P = key
    S, ps, i = min(T, engine.max_num_seqs), engine.page_size, np.arange(batch)
    table = np.zeros((S, P), np.int32)
    table[:batch, :-(-ctx // ps)] = first_page + i[:, None] * P + np.arange(-(-ctx // ps))
    pad = lambda n, v, fill: np.concatenate([v, np.full(n - len(v), fill)])
    pos = ctx - 1
    parts = dict(tokens=pad(T, np.random.default_rng(seed).integers(0, 100, batch), 0),
                 positions=pad(T, np.full(batch, pos), 0),
                 kv_slots=pad(T, table[:batch, pos // ps] * ps + pos % ps, -1),
                 sources=pad(T, i, -1),
                 query_start=pad(S + 1, np.arange(batch + 1), batch),
                 context_lens=pad(S, np.full(batch, ctx), 0),
                 logits_indices=pad(S, i, 0), page_table=table.ravel())
    layout = int_layout(T, S, P)
    assert list(parts) == list(layout), f"the engine's int layout changed: {list(layout)}"
    ints = np.concatenate([parts[k] for k in layout]).astype(np.int32)
    floats, rows = sampling.pack_rows([dict(temperature=0.0)] * batch, S)
    sample_ints = np.concatenate([pad(S, i, -1), rows.ravel()]).astype(np.int32)
    return ints, sample_ints, floats.ravel()


def make_step(engine, key, inputs, exe=None):
    """One step exactly as `Engine._launch` runs it: forward, greedy sampler, an early copy of
    the result to the host, the device state handed on (donated)."""
    ints, sample_ints, floats = inputs
    exe = exe or engine._exe[key]
    sampler = engine._samplers[(min(key[0], engine.max_num_seqs), "greedy")]

    def step():
        kv, last_tokens, history = engine.state
        logits, kv = exe(engine.params, kv, last_tokens, ints)
        out, last_tokens, history = sampler(logits, last_tokens, history, sample_ints, floats)
        out.copy_to_host_async()
        engine.state = (kv, last_tokens, history)
        return out
    return step


def time_steps(step, n_sync: int, n_pipe: int) -> dict:
    for _ in range(3):
        np.asarray(step())
    synced = []
    for _ in range(n_sync):
        t = time.perf_counter()
        np.asarray(step())
        synced.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [step() for _ in range(n_pipe)]
    np.asarray(outs[-1])  # each step waits on the previous one's KV: the last ends last
    pipelined = (time.perf_counter() - t) / n_pipe
    return dict(synced_ms=1e3 * float(np.median(synced)), pipelined_ms=1e3 * pipelined)


def trace_steps(step, n: int, directory: str) -> str:
    """Profile `n` pipelined steps; returns the perfetto trace file JAX wrote."""
    import jax
    np.asarray(step())
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        outs = [step() for _ in range(n)]
        np.asarray(outs[-1])
    found = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    return found[-1]


def engine_loop(engine, prompt_len: int, tokens: int) -> dict:
    """Batch-1 decode through `Engine.step()` (one-step-ahead overlap on): the median time
    between consecutive decode steps' results, as benchmarks/bench_serving.py measures it."""
    from pallasite.serving.llm import SamplingParams
    prompt = np.random.default_rng(1).integers(0, engine.config.vocab_size, prompt_len).tolist()
    engine.step_log = []
    engine.add_request("profile-b1", prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    log, engine.step_log = engine.step_log, None
    dts = [b["done"] - a["done"] for a, b in zip(log, log[1:])
           if "done" in a and "done" in b and b["tokens"] == 1]
    return dict(engine_ms=1e3 * float(np.median(dts)), decode_steps=len(dts),
                host_ms_per_step=engine.stats()["host_ms_per_step"])


def step_bytes(params, config, batch, ctx) -> dict:
    """What a decode step must read: the weights (the embedding table only through its
    gathered rows, unless it is also the output projection) and the K/V of its contexts."""
    import jax
    layers = sum(x.nbytes for k, v in params.items() if k.startswith("layers_")
                 for x in jax.tree.leaves(v))
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * \
        params["embed"].dtype.itemsize * batch * ctx
    return dict(layer_weights=layers, lm_head=head.nbytes, kv=kv, total=layers + head.nbytes + kv)


def child(args):
    import jax
    import jax.numpy as jnp
    from pallasite.kernels import choose_impl
    from pallasite.model import config_from_dict
    start, full = time.time(), args.child == "default"
    deadline = args.deadline or start + 1e9
    model, w = workload(args.tiny)
    res = dict(env=dict(variant=args.child, xla_flags=os.environ.get("XLA_FLAGS", ""),
                        device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                        attention=choose_impl(), model="tiny" if args.tiny else "llama3-8b-shaped",
                        layers=model["num_hidden_layers"]))
    print(json.dumps(res["env"]), flush=True)
    if full:  # before the weights and pages take the memory
        from profiling.probe_gpu import copy_bandwidth
        bw, how = copy_bandwidth(gb=0.05 if args.tiny else 4)
        res.update(copy_tbps=bw / 1e12, copy_how=how)
    config = config_from_dict(dict(model_type="llama", **model))
    params = random_params(config, jnp.dtype(w["dtype"]))
    engine = make_engine(config, params, w)
    specs = cases(w)
    t = time.time()
    prefill_key = (w["b1"][1], specs["b1"][2][1]) if full else None  # for Engine.step()
    graph_exes = compile_all(engine, [s[2] for s in specs.values()], prefill_key, keep_graphs=full)
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
    """Time one decode batch; in the default variant also trace it, with graphs off (as XLA
    runs under a profiler) and, where that compiled, with command buffers kept."""
    batch, ctx, key, first_page = spec
    inputs = decode_inputs(engine, batch, ctx, key, first_page)
    step = make_step(engine, key, inputs)
    case = dict(batch=batch, context=ctx, bucket=list(key), **time_steps(step, *w["steps"]))
    case["bytes"] = step_bytes(engine.params, config, batch, ctx)
    if copy_tbps:
        case["roofline_ms"] = case["bytes"]["total"] / copy_tbps / 1e9
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


# -- the trace and the HLO ---------------------------------------------------------------------
# Lines of a device that XLA's profiler derives from the kernels (not work of their own).
DERIVED = re.compile(r"XLA Ops|XLA Modules|Steps|TensorFlow|Framework|Source|Launch|TraceMe|"
                     r"Name Scope", re.I)
GEMM_NAMES = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitkreduce|matmul|triton_gemm")


def device_ops(path: str) -> dict:
    """The device's work in a perfetto trace: every GPU event (kernels, copies, memsets) where a
    GPU was traced; else (CPU) XLA's thunk events, which name the HLO op they run."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, lines = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            lines[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    gpus = {pid for pid, name in procs.items() if "/device:GPU" in name}
    ops, seen = [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        line = lines.get((e["pid"], e.get("tid")), str(e.get("tid")))
        args = e.get("args", {})
        if gpus and (e["pid"] not in gpus or DERIVED.search(line)):
            continue
        if not gpus and ("hlo_op" not in args or e["name"].startswith("end: ")):
            continue
        seen[line] = seen.get(line, 0) + 1
        ops.append(dict(name=e["name"], ts=float(e["ts"]), dur=float(e.get("dur", 0.0)),
                        hlo_op=args.get("hlo_op"), hlo_module=args.get("hlo_module")))
    return dict(ops=ops, lines=seen, device="gpu" if gpus else "cpu")


INST = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$")
HEAD = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)")


def norm(name: str) -> str:
    """Kernel names are HLO names with '.' and '-' made '_': compare them that way."""
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def parse_hlo(text: str, role: str) -> dict:
    """A compiled module's instructions: opcode, output shape dims, the ops of what it calls (a
    fusion's body), the JAX op_name it came from and any custom-call target."""
    head = re.search(r"^HloModule\s+([^\s,]+)", text, re.M)
    comps, rests, current = {}, {}, None
    for line in text.splitlines():
        m = INST.match(line)
        if m and current is not None:
            rests[m.group(1)] = m.groups()[1:]
            comps[current].append(m.group(1))
        elif (h := HEAD.match(line)) and " = " not in line:
            current = h.group(1)
            comps[current] = []
    memo = {}

    def ops_of(name, depth=0):
        if name not in memo:
            memo[name] = {rests[name][1]}
            for comp in CALLS.findall(rests[name][2]) if depth < 8 else []:
                for sub in comps.get(comp, []):
                    memo[name] |= ops_of(sub, depth + 1)
        return memo[name]

    insts = {}
    for name, (shape, opcode, rest) in rests.items():
        meta = re.search(r'op_name="([^"]*)"', rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        dims = {int(d) for group in re.findall(r"\[([\d,]*)\]", shape)
                for d in group.split(",") if d}
        insts[name] = dict(name=name, opcode=opcode, ops=ops_of(name), dims=dims, role=role,
                           op_name=meta.group(1) if meta else "",
                           target=target.group(1) if target else "")
    return dict(name=head.group(1) if head else role, role=role, insts=insts,
                by_norm={norm(n): i for n, i in insts.items()})


def lookup(op: dict, modules: list[dict]) -> dict | None:
    """The HLO instruction a device op ran: by the op name the profiler attached, else by the
    kernel's own name (XLA names a fusion's kernel after the fusion)."""
    mod = op.get("hlo_module") or ""
    mine = [m for m in modules if mod and (mod.startswith(m["name"]) or m["name"].startswith(mod))]
    for m in mine or modules:
        for key in (op.get("hlo_op"), op["name"]):
            if key and (key in m["insts"] or norm(key) in m["by_norm"]):
                return m["insts"].get(key) or m["by_norm"][norm(key)]
    for m in mine or modules:  # a kernel named after its fusion plus a suffix
        names = [n for n in m["by_norm"] if norm(op["name"]).startswith(n + "_")]
        if names:
            return m["by_norm"][max(names, key=len)]
    return None


def categorize(name: str, inst: dict | None, vocab: int) -> str:
    low = name.lower()
    if re.search(r"memcpy|memset", low):
        return "copy/memset"
    if "paged_attention" in low:  # the Pallas kernel is named after its pallas_call
        return "attention kernel"
    if inst is None:  # a library kernel the profiler did not tie to an HLO op
        return "matmul" if GEMM_NAMES.search(low) else "other"
    if inst["role"] == "sampler":
        return "sampler"
    ops, meta, target = inst["ops"], inst["op_name"].lower(), inst["target"].lower()
    if "pallas_call" in meta or (inst["opcode"] == "custom-call" and "triton" in target):
        return "attention kernel"
    if "scatter" in ops or re.search(r"(^|/)scatter", meta):
        return "KV write"
    if ops & {"dot", "convolution"} or GEMM_NAMES.search(target) or meta.endswith("dot_general"):
        return "logits/lm_head" if vocab in inst["dims"] else "matmul"
    if "paged_attention" in meta:  # the jnp around the kernel, inside its jit
        return "split-K merge" if "reduce" in ops else "attention glue"
    if vocab in inst["dims"]:
        return "logits/lm_head"
    if ops <= {"copy", "transpose", "bitcast", "reshape", "slice", "concatenate", "parameter",
               "tuple", "get-tuple-element"}:  # moves bytes, computes nothing
        return "copy/memset"
    return "norm/RoPE/elementwise" if inst["opcode"] == "fusion" else "other"


def label(op: dict, inst: dict | None) -> str:
    """A kernel's name without its instance number, and where in the model it came from."""
    base = re.sub(r"([._]\d+)+$", "", op["name"])[:48]
    if inst is None or not inst["op_name"]:
        return base
    where = re.sub(r"layers_\d+", "layers_N", re.sub(r"^jit\([^)]*\)/", "", inst["op_name"]))
    return f"{base} | {'/'.join(where.split('/')[-3:])[:60]}"


def union_us(spans) -> float:
    total, end = 0.0, -1e300
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def breakdown(trace: dict, modules: list[dict], steps: int, vocab: int, wall_ms: float) -> dict:
    """Per step: device ops, their summed and merged (busy) time, the time the device sat idle
    in the pipelined step (`idle_ms` = wall - busy), the gaps between ops in the trace (each
    charged to the category of the op after it), time per category and the top 15 kernels."""
    ops = sorted(trace["ops"], key=lambda o: o["ts"])
    per_step = lambda us: us / 1e3 / steps  # microseconds in the trace -> ms per step
    cats = {c: dict(calls=0.0, ms=0.0, gap_ms=0.0) for c in CATEGORIES}
    groups, memo, gaps, unmatched, end = {}, {}, [], 0, None
    for o in ops:
        key = (o["hlo_module"], o["hlo_op"], o["name"])
        inst = memo[key] if key in memo else memo.setdefault(key, lookup(o, modules))
        unmatched += inst is None
        cat = categorize(o["name"], inst, vocab)
        group = groups.setdefault(label(o, inst), dict(category=cat, calls=0.0, ms=0.0))
        for d in (cats[cat], group):
            d["calls"] += 1 / steps
            d["ms"] += per_step(o["dur"])
        if end is not None:
            gaps.append(max(0.0, o["ts"] - end))
            cats[cat]["gap_ms"] += per_step(gaps[-1])
        end = max(end or 0.0, o["ts"] + o["dur"])
    kernel_ms = per_step(sum(o["dur"] for o in ops))
    busy_ms = per_step(union_us((o["ts"], o["ts"] + o["dur"]) for o in ops))
    span_ms = per_step(end - ops[0]["ts"]) if ops else 0.0
    for c in cats.values():
        c["share"] = c["ms"] / kernel_ms if kernel_ms else 0.0
    top = sorted(groups.items(), key=lambda kv: -kv[1]["ms"])[:15]
    return dict(device=trace["device"], steps=steps, ops_per_step=len(ops) / steps,
                kernel_ms=kernel_ms, busy_ms=busy_ms, span_ms=span_ms, wall_ms=wall_ms,
                idle_ms=wall_ms - busy_ms, traced_idle_ms=span_ms - busy_ms,
                gap_us=dict(median=float(np.median(gaps)) if gaps else 0.0,
                            p90=float(np.percentile(gaps, 90)) if gaps else 0.0),
                unmatched_per_step=unmatched / steps, lines=trace["lines"],
                categories={k: v for k, v in cats.items() if v["calls"]},
                top=[dict(kernel=k, **v) for k, v in top])


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
    head = (f"== {name}: batch {case['batch']}, context {case['context']}, bucket T,P = "
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
