"""Sharding benchmark: decode step time of a model split over 1, 2, 4 GPUs, the collectives it
uses measured alone, and cheaper all-reduce settings tried side by side.

    python -m benchmarks.bench_sharding --out DIR --time-limit 270   # every GPU this machine has
    python -m benchmarks.bench_sharding --tiny --out DIR             # tiny shapes, 8 fake CPU devices

What runs, in this order, each part in its own process (so that environment variables and
XLA_FLAGS are set before JAX loads, and so that a bad flag is a failed part, not a failed run):

1. main: a Llama-3-70B-shaped stack (as many layers as one device holds with room, reported per
   layer and scaled to 80) at tp = 1, 2, 4 and a Mixtral-8x7B-shaped MoE (reduced layers) at
   ep = 1, 2, 4 and tp = 2, 4, as far as the devices go, decoding at batch 1, 8, 64 with
   `--context` tokens per sequence. Each mesh times the cached paged step (`Layout.forward`)
   synchronously (every call waited on, as serving does) and pipelined (calls queued, one wait),
   and checks its logits against the one-device mesh. Weights and KV pages are random bf16 made
   on the devices straight into their shardings (threefry is partitionable, so every mesh gets
   the same values). Then all-reduce and all-to-all alone (jit + shard_map over 2, 4, 8 devices):
   at the message sizes one decode step sends per layer at each batch, and over a size sweep.
2. variants (needs 2 devices): the tp=2 batch-1 decode step (`--variant-layers` layers) and the
   decode-size all-reduces under each setting of VARIANTS, with a device trace of the step that
   splits its time into collective kernels, other kernels and idle gaps. `default` also runs tp=1,
   the base of every variant's speed-up.

Parts are skipped once `--time-limit` seconds are spent (recorded as skipped); the main part gets
the first (1 - `--variant-share`) of it. NVLink multicast stays off in every part
(NCCL_NVLS_ENABLE=0). Writes DIR/sharding.json (every record, with the GPU, JAX version, date,
command), DIR/parts/*.log (each part's output) and prints short tables last.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Settings tried for small all-reduces, most promising first (the time limit may cut the tail).
# Flag names are from XLA's debug_options_flags.cc and parse in JAX 0.10.2's XLA; an unknown one
# aborts XLA at start, which fails only that part.
ONE_SHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"  # P2P kernel, no multicast
SYNC_AR = "--xla_gpu_disable_async_collectives=ALLREDUCE"  # on the compute stream, no events
# Collectives inside CUDA graphs; kept there under the profiler too, so the trace shows them.
CMD_BUF = ("--xla_gpu_enable_command_buffer=+COLLECTIVES "
           "--xla_enable_command_buffers_during_profiling=true")
VARIANTS = {
    "default": {},
    "xla_one_shot": {"XLA_FLAGS": ONE_SHOT},
    "cmd_buffer_collectives": {"XLA_FLAGS": CMD_BUF},
    "combined": {"XLA_FLAGS": f"{ONE_SHOT} {SYNC_AR} {CMD_BUF}"},
    "nccl_ll": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"},
    "nccl_ll128": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"},
    "sync_all_reduce": {"XLA_FLAGS": SYNC_AR},  # last: XLA makes adjacent start/done sync itself
}
# Multicast can take a shared host's GPUs out of service: forced off in every part.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
DENSE, MOE = "llama3-70b-shaped", "mixtral-8x7b-shaped"
FULL_LAYERS = {DENSE: 80, MOE: 32}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on 8 fake CPU devices")
    ap.add_argument("--layers", type=int, default=None,
                    help="dense layers (default: what --mem-fraction of one device holds)")
    ap.add_argument("--max-layers", type=int, default=40, help="cap on the automatic count")
    ap.add_argument("--mem-fraction", type=float, default=0.6,
                    help="share of one device's memory the tp=1 weights and KV pages may use")
    ap.add_argument("--moe-layers", type=int, default=None, help="MoE layers (default 4)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,64)")
    ap.add_argument("--tp", default="1,2,4", help="dense tensor-parallel sizes")
    ap.add_argument("--ep", default="1,2,4", help="MoE expert-parallel sizes")
    ap.add_argument("--moe-tp", default="2,4", help="MoE tensor-parallel sizes to compare")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 1024)")
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill of N tokens")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per step (default 30)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"settings to try ('none' for no variants): {', '.join(VARIANTS)}")
    ap.add_argument("--main-variant", default="default", choices=list(VARIANTS),
                    help="setting the main part runs under")
    ap.add_argument("--variant-layers", type=int, default=None, help="dense layers (default 8)")
    ap.add_argument("--variant-tp", type=int, default=2)
    ap.add_argument("--variant-share", type=float, default=0.4,
                    help="share of --time-limit kept for the variants")
    ap.add_argument("--time-limit", type=float, default=270,
                    help="seconds after which the remaining parts are skipped (recorded so)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # 'main' or 'variant:NAME'
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(argv)
    tiny = args.tiny
    defaults = dict(moe_layers=2 if tiny else 4, batches="1,8" if tiny else "1,8,64",
                    context=64 if tiny else 1024, iters=3 if tiny else 30,
                    variant_layers=2 if tiny else 8)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    ints = lambda s: [int(x) for x in str(s).split(",") if x]
    args.batches, args.tp, args.ep, args.moe_tp = map(ints, (args.batches, args.tp, args.ep,
                                                             args.moe_tp))
    args.variants = [] if args.variants == "none" else args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    return args


# -- the parent: runs each part in a child process and merges what they wrote -------------------

def child_env(args, variant: str) -> dict:
    """The environment of a part: this one, the variant's settings on top, multicast off."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if args.tiny:
        flags += " --xla_force_host_platform_device_count=8"
        env["JAX_PLATFORMS"] = "cpu"
    for key, value in VARIANTS[variant].items():
        if key == "XLA_FLAGS":
            flags += " " + value
        else:
            env[key] = value
    env["XLA_FLAGS"] = flags.strip()
    env.setdefault("NCCL_DEBUG", "VERSION")  # one line naming the NCCL version
    env["PYTHONUNBUFFERED"] = "1"
    env.update(NO_MULTICAST)
    return env


def run_child(args, name: str, env: dict, deadline: float, timeout: float) -> dict:
    """Runs one part; echoes its progress lines ('> ...'), keeps its whole output in
    DIR/parts/NAME.log, and returns what it wrote to DIR/parts/NAME.json (or an error)."""
    stem = os.path.join(args.out, "parts", name.replace(":", "_"))
    cmd = [sys.executable, "-m", "benchmarks.bench_sharding", *args.argv, "--child", name,
           "--deadline", f"{deadline:.1f}"]
    started, tail = time.time(), collections.deque(maxlen=25)
    nccl = []
    with open(stem + ".log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                nccl.extend(re.findall(r"NCCL version (\S+)", line)[:1])
                if line.startswith("> "):
                    print(f"[{name}] {line[2:]}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:  # our own child's process group, by its id
            os.killpg(proc.pid, signal.SIGKILL)
            rc = f"killed after {timeout:.0f} s (time limit)"
            proc.wait()
        reader.join(10)
    part = {"records": []}
    if os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            part = json.load(f)
    part["wall_s"], part["rc"] = round(time.time() - started, 1), rc
    part["nccl_version"] = nccl[0] if nccl else None
    if rc != 0:
        print(f"[{name}] failed ({rc}); last lines:\n  " + "\n  ".join(tail), flush=True)
        part["error"] = f"exit {rc}: " + " | ".join(list(tail)[-6:])[-1500:]
    return part


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child_main(args)
    os.environ.update(NO_MULTICAST)
    started = time.time()
    end = started + args.time_limit
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    share = args.variant_share if args.variants else 0.0
    main_part = run_child(args, "main", child_env(args, args.main_variant),
                          deadline=end - share * args.time_limit, timeout=end - started + 20)
    meta = main_part.get("meta", {})
    records = [dict(r, variant=args.main_variant) for r in main_part["records"]]
    if "error" in main_part:
        records.append(dict(kind="step", part="main", model="main part", mesh="",
                            error=main_part["error"]))
    parts = {"main": {k: main_part.get(k) for k in ("wall_s", "rc", "nccl_version")}}
    records += run_variants(args, meta.get("devices", 0), end, parts)
    finish(args, started, meta, parts, records)
    # A failed variant is a finding, reported in the records; a failed main part is not.
    return 0 if all("error" not in r for r in records if r.get("part") == "main") else 1


def run_variants(args, devices: int, end: float, parts: dict) -> list:
    """Each variant in its own part while time is left; the estimate of a part's length is the
    last one's (the first guess: 20 s on CPU, 35 s on GPUs)."""
    records, estimate = [], 20.0 if args.tiny else 35.0
    for name in args.variants:
        left = end - time.time()
        why = (f"needs {args.variant_tp} devices; {devices} found" if devices < args.variant_tp
               else f"time limit ({left:.0f} s left, a part takes ~{estimate:.0f} s)"
               if left < estimate else None)
        if why:
            records.append(dict(kind="variant", variant=name, skipped=why))
            print(f"[variant:{name}] skipped: {why}", flush=True)
            continue
        part = run_child(args, f"variant:{name}", child_env(args, name), deadline=end,
                         timeout=left + 20)
        estimate = part["wall_s"]
        parts[name] = {k: part.get(k) for k in ("wall_s", "rc", "nccl_version")}
        got = [dict(r, variant=name, settings=VARIANTS[name]) for r in part["records"]]
        if "error" in part or not any("step_ms" in r for r in got):
            got.append(dict(kind="variant", variant=name, settings=VARIANTS[name],
                            error=part.get("error") or "no step measured"))
        records += got
    return records


def finish(args, started, meta, parts, records):
    """Speed-ups across parts, the common keys on every record, the JSON file and the tables."""
    date = datetime.date.today().isoformat()
    variant_speedups(records)
    for r in records:
        for key in ("model", "tp", "ep", "dp", "batch", "step_ms_per_layer", "speedup_vs_tp1"):
            r.setdefault(key, None)
        r.setdefault("gpu", meta.get("gpu"))
        r.setdefault("gpus", None)
        r.setdefault("date", date)
    result = dict(gpu=meta.get("gpu"), gpus=meta.get("devices"), platform=meta.get("platform"),
                  jax_version=meta.get("jax_version"), date=date,
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                  args={k: v for k, v in vars(args).items() if k not in ("argv", "child")},
                  parts=parts, wall_s=round(time.time() - started, 1),
                  targets=targets(records), records=records)
    path = os.path.join(args.out, "sharding.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    nccl = next((p["nccl_version"] for p in parts.values() if p.get("nccl_version")), None)
    print(f"\n{result['gpu']} x{result['gpus']}, JAX {result['jax_version']}, NCCL {nccl}, "
          f"{result['wall_s']} s; records in {path}")
    print(tables(records, result["targets"]))


def variant_speedups(records):
    """Variant steps against the default variant's tp=1 and tp=2 steps (same layers, batch)."""
    base = {(r["tp"], r["batch"]): r["step_ms"] for r in records
            if r.get("kind") == "step" and r.get("part") == "variant"
            and r.get("variant") == "default" and "step_ms" in r}
    for r in records:
        if r.get("part") == "variant" and "step_ms" in r:
            one, same = base.get((1, r["batch"])), base.get((r["tp"], r["batch"]))
            r["speedup_vs_tp1"] = round(one / r["step_ms"], 3) if one else None
            r["speedup_vs_default"] = round(same / r["step_ms"], 3) if same else None


def targets(records) -> dict:
    """The issue's goal for the 70B-shaped stack at batch 1: tp=2 >= 1.8x, tp=4 >= 3.0x."""
    out = {}
    for tp, goal in ((2, 1.8), (4, 3.0)):
        r = next((r for r in records if r.get("kind") == "step" and r.get("part") == "main"
                  and r["model"] == DENSE and r["tp"] == tp and r["batch"] == 1
                  and r.get("step") == "decode b=1"), None)
        speedup = r.get("speedup_vs_tp1") if r else None
        out[f"tp={tp}"] = dict(goal=goal, speedup=speedup,
                               met=None if speedup is None else speedup >= goal)
    return out


# -- a child: one part, its records written after every unit of work ----------------------------

def child_main(args):
    import jax
    try:  # the default since JAX 0.5; set so every mesh draws the same random weights
        jax.config.update("jax_threefry_partitionable", True)
    except Exception:
        pass
    devices = jax.devices()
    stem = os.path.join(args.out, "parts", args.child.replace(":", "_"))
    part = dict(meta=dict(gpu=devices[0].device_kind, devices=len(devices),
                          platform=devices[0].platform, jax_version=jax.__version__),
                records=[])

    def save(records):
        part["records"].extend(records)
        with open(stem + ".json", "w") as f:
            json.dump(part, f, indent=1)

    save([])
    say(f"{len(devices)} x {devices[0].device_kind}, JAX {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if args.child == "main":
        run_main(args, devices, save)
    else:
        run_variant(args, args.child.split(":", 1)[1], devices, save)
    return 0


def say(text):
    print("> " + text, flush=True)


def late(args) -> bool:
    return args.deadline is not None and time.time() > args.deadline


def run_main(args, devices, save):
    n = len(devices)
    dense, moe = models(args)
    layers = args.layers or dense_layers(args, dense, devices)
    tps = [t for t in args.tp if t <= n]
    meshes = [(f"tp={t}", (1, t, 1)) for t in tps]
    measure_model(args, DENSE, {**dense, "num_hidden_layers": layers}, meshes, args.batches,
                  save, part="main")
    groups = [g for g in (2, 4, 8) if g <= n]
    save(collective_records(args, devices, groups, dense, moe, part="main"))
    meshes = [("ep=1", (1, 1, 1))] + [(f"ep={e}", (1, 1, e)) for e in args.ep if 1 < e <= n]
    meshes += [(f"tp={t}", (1, t, 1)) for t in args.moe_tp if t <= n]
    measure_model(args, MOE, {**moe, "num_hidden_layers": args.moe_layers}, meshes,
                  args.batches, save, part="main")


def run_variant(args, name, devices, save):
    """tp=2 (and, for the default, tp=1) batch-1 decode with a device trace, and the all-reduce
    alone at the per-layer decode sizes, under this part's settings."""
    dense, _ = models(args)
    tp = args.variant_tp
    meshes = ([("tp=1", (1, 1, 1))] if name == "default" else []) + [(f"tp={tp}", (1, tp, 1))]
    measure_model(args, DENSE, {**dense, "num_hidden_layers": args.variant_layers}, meshes, [1],
                  save, part="variant", profile=True)
    if not late(args):
        save(collective_records(args, devices, [tp], dense, None, part="variant", sweep=False))


# -- models ---------------------------------------------------------------------------------------

def models(args):
    """HF-style config dicts (without the layer count) of the dense and the MoE model."""
    if args.tiny:
        dense = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2)
        moe = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2)
    else:
        dense = dict(model_type="llama", vocab_size=128256, hidden_size=8192,
                     intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                     rope_theta=500000.0)
        moe = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                   intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6)
    common = dict(max_position_embeddings=8192, tie_word_embeddings=False)
    return {**dense, **common}, {**moe, **common}


def dense_layers(args, raw, devices) -> int:
    """As many layers as `--mem-fraction` of one device holds (weights and KV pages of the
    largest batch), at most `--max-layers` (compile time grows with them)."""
    import jax
    from pallasite.model import config_from_dict, param_shapes
    if args.tiny:
        return 2
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        return 8
    config = config_from_dict({**raw, "num_hidden_layers": 1})
    shapes = param_shapes(config)
    size = lambda tree: 2 * sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # bf16
    layer = size(shapes["layers_0"])
    fixed = size(shapes) - layer
    kv = 2 * 2 * config.num_kv_heads * num_pages(args) * args.page_size * config.head_dim
    n = int((args.mem_fraction * limit - fixed) // (layer + kv))
    say(f"dense layers: {n} fit in {args.mem_fraction:.0%} of {limit / 1e9:.1f} GB "
        f"({layer / 1e9:.2f} GB weights + {kv / 1e9:.2f} GB KV a layer); using "
        f"{max(2, min(n, args.max_layers))}")
    return max(2, min(n, args.max_layers))


# -- steps ----------------------------------------------------------------------------------------

def pages_per_seq(args) -> int:
    return -(-max(args.context, args.prefill) // args.page_size)


def num_pages(args) -> int:
    return 1 + max(args.batches) * pages_per_seq(args)


def paged_inputs(rng, vocab, lengths, starts, width, page_size):
    """(tokens, positions, Batch) for sequences i = 0.. computing tokens starts[i]..+lengths[i],
    sequence i owning pages 1 + i * width ... (page 0 is left unused)."""
    import jax.numpy as jnp
    import numpy as np
    from pallasite.model import Batch
    n = len(lengths)
    table = 1 + np.arange(n)[:, None] * width + np.arange(width)[None]
    pos = np.concatenate([np.arange(a, a + l) for a, l in zip(starts, lengths)])
    seq = np.repeat(np.arange(n), lengths)
    slots = table[seq, pos // page_size] * page_size + pos % page_size
    qstart = np.concatenate([[0], np.cumsum(lengths)])
    ctx = np.asarray(starts) + np.asarray(lengths)
    tokens = rng.integers(0, vocab, len(pos))
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    return i32(tokens), i32(pos), Batch(i32(qstart), i32(ctx), i32(table), i32(slots),
                                        i32(qstart[1:] - 1))


def step_inputs(args, config, batches, rng):
    """Decode at batch b: sequences 0..b-1 each computing its token at position `context - 1`
    over random K/V; with --prefill, also sequence 0's first `prefill` tokens."""
    shapes = {"prefill": ([args.prefill], [0])} if args.prefill else {}
    for b in batches:
        shapes[f"decode b={b}"] = ([1] * b, [args.context - 1] * b)
    return {name: paged_inputs(rng, config.vocab_size, lengths, starts, pages_per_seq(args),
                               args.page_size)
            for name, (lengths, starts) in shapes.items()}


def random_kv(layout, config, pages, page_size, seed):
    """Random bf16 K/V pages for every layer, made on their shards. Where each tensor shard holds
    a copy of one kv head, the copies are taken from the same full draw, so every mesh attends
    over the same values."""
    import jax
    import jax.numpy as jnp
    from pallasite.sharding.rules import kv_heads_split
    kv, tp = config.num_kv_heads, layout.plan.tensor
    heads = None if kv_heads_split(config, layout.plan) else jnp.array(
        [i * kv // tp for i in range(tp)])

    def draw(key):
        x = jax.random.normal(key, (2, kv, pages, page_size, config.head_dim), jnp.bfloat16)
        x = x if heads is None else x[:, heads]
        return x[0], x[1]

    fill = jax.jit(draw, out_shardings=(layout.kv_pages, layout.kv_pages))
    return [fill(jax.random.key(seed * 1000 + i)) for i in range(config.num_layers)]


def compile_all(layout, params, kv, inputs):
    """Every step's executable, compiled in parallel threads (XLA compiles are independent)."""
    from concurrent.futures import ThreadPoolExecutor
    fn = layout.forward()
    lowered = {name: fn.lower(params, x[0], x[1], kv, x[2]) for name, x in inputs.items()}
    with ThreadPoolExecutor(len(lowered)) as pool:
        return dict(zip(lowered, pool.map(lambda lo: lo.compile(), lowered.values())))


def timed(exe, params, kv, x, iters):
    """Synchronous: median, 10th and 90th percentile ms of `iters` calls, each waited on, after
    3 warm-up calls. Pipelined: ms a call of `iters` calls queued back to back, one wait (the
    host's dispatch hidden behind the device's work). The KV pages go round (donated)."""
    import jax
    import numpy as np
    times = []
    for i in range(iters + 3):
        t = time.perf_counter()
        logits, kv = exe(params, x[0], x[1], kv, x[2])
        jax.block_until_ready(logits)
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - t))
    t = time.perf_counter()
    for _ in range(iters):
        logits, kv = exe(params, x[0], x[1], kv, x[2])
    jax.block_until_ready(logits)
    stats = dict(zip(("step_ms", "p10_ms", "p90_ms"), np.percentile(times, [50, 10, 90])))
    stats["pipelined_ms"] = 1e3 * (time.perf_counter() - t) / iters
    return {k: round(float(v), 4) for k, v in stats.items()}, kv


def measure_mesh(args, model, config, mesh_name, shape, inputs, part, profile):
    """Records for one mesh and {step: logits of its first call} for the check."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallasite.model import init_params
    from pallasite.sharding import Layout, MeshPlan, make_mesh
    plan = MeshPlan(*shape)
    layout = Layout(config, make_mesh(plan))
    params = jax.jit(lambda: init_params(config, args.seed, jnp.bfloat16),
                     out_shardings=layout.params)()
    kv = random_kv(layout, config, num_pages(args), args.page_size, args.seed)
    inputs = {k: (*layout.replicate(x[:2]), layout.replicate(x[2])) for k, x in inputs.items()}
    t = time.perf_counter()
    exes = compile_all(layout, params, kv, inputs)
    compile_s = round(time.perf_counter() - t, 2)
    check = {}
    for step, exe in exes.items():  # the same calls in the same order on every mesh
        logits, kv = exe(params, *inputs[step][:2], kv, inputs[step][2])
        check[step] = np.asarray(logits.astype(jnp.float32))
    records, layers = [], config.num_layers
    for step, exe in exes.items():
        stats, kv = timed(exe, params, kv, inputs[step], args.iters)
        tokens = int(inputs[step][0].shape[0])
        per_layer = stats["step_ms"] / layers
        records.append(dict(
            kind="step", part=part, model=model, mesh=mesh_name, dp=plan.data, tp=plan.tensor,
            ep=plan.expert, gpus=plan.size, layers=layers, step=step,
            batch=1 if step == "prefill" else tokens, tokens=tokens,
            context=args.prefill if step == "prefill" else args.context, iters=args.iters,
            compile_s=compile_s, **stats, step_ms_per_layer=round(per_layer, 5),
            pipelined_ms_per_layer=round(stats["pipelined_ms"] / layers, 5),
            full_layers=FULL_LAYERS[model],
            step_ms_full_layers=round(per_layer * FULL_LAYERS[model], 3),
            hlo=hlo_stats(exe.as_text())))
        if profile and step == "decode b=1" and not late(args):
            records[-1]["profile"], kv = traced(exe, params, kv, inputs[step])
    return records, check


def traced(exe, params, kv, x):
    """`device_profile` of one step's calls; returns (its summary, the KV pages)."""
    import jax
    state = {"kv": kv}

    def run(n):
        for _ in range(n):
            logits, state["kv"] = exe(params, x[0], x[1], state["kv"], x[2])
        jax.block_until_ready(logits)

    return device_profile(run), state["kv"]


def measure_model(args, model, raw, meshes, batches, save, part, profile=False):
    """Every mesh of one model in turn; meshes after a one-device mesh are compared with it."""
    import numpy as np
    from pallasite.model import config_from_dict
    config = config_from_dict(raw)
    inputs = step_inputs(args, config, batches, np.random.default_rng(args.seed))
    base = None
    for mesh_name, shape in meshes:
        head = dict(kind="step", part=part, model=model, mesh=mesh_name, dp=shape[0],
                    tp=shape[1], ep=shape[2], gpus=math.prod(shape), layers=config.num_layers)
        if late(args):
            save([dict(head, skipped="time limit")])
            say(f"{model} {mesh_name}: skipped (time limit)")
            continue
        try:
            records, check = measure_mesh(args, model, config, mesh_name, shape, inputs, part,
                                          profile)
        except Exception as e:  # record it and go on: the other meshes may still be measured
            save([dict(head, error=f"{type(e).__name__}: {e}"[:2000])])
            say(f"{model} {mesh_name}: {type(e).__name__}: {e}"[:500])
            continue
        finally:
            gc.collect()  # this mesh's weights leave the devices before the next one's arrive
        if math.prod(shape) == 1:
            base = (records, check)
            for r in records:
                r["speedup_vs_tp1"] = r["pipelined_speedup_vs_tp1"] = 1.0
        elif base is not None:
            compare(records, check, *base)
        save(records)
        for r in records:
            say(f"{model} {mesh_name} {r['step']}: {r['step_ms']:.3f} ms sync, "
                f"{r['pipelined_ms']:.3f} pipelined, {r['step_ms_per_layer']:.4f} a layer "
                f"(x{r.get('speedup_vs_tp1')}; compile {r['compile_s']} s)")


def compare(records, check, base_records, base_check):
    """Speed-up over the one-device mesh and the largest logits difference from it."""
    import numpy as np
    base = {r["step"]: r for r in base_records}
    for r in records:
        b, got, want = base.get(r["step"]), check[r["step"]], base_check.get(r["step"])
        if b is None:
            continue
        r["speedup_vs_tp1"] = round(b["step_ms"] / r["step_ms"], 3)
        r["pipelined_speedup_vs_tp1"] = round(b["pipelined_ms"] / r["pipelined_ms"], 3)
        r["max_abs_logit_diff"] = float(np.max(np.abs(got - want)))
        r["max_abs_logit"] = float(np.max(np.abs(want)))


# -- collectives alone ----------------------------------------------------------------------------

def sweep_sizes(args):
    return [1 << 10, 1 << 14, 1 << 18] if args.tiny else [4 << (2 * i) << 10 for i in range(8)]


def collective_records(args, devices, groups, dense, moe, part, sweep=True):
    """All-reduce (and, with `moe`, all-to-all) alone over the first g devices for each g in
    `groups`: at the bytes one decode step sends per layer at each batch (bf16 activations; the
    dense model all-reduces its residual twice a layer, the MoE all-to-alls its routed rows there
    and back), and at `sweep_sizes` (bytes per device) to show latency against bandwidth."""
    jobs = []
    for b in args.batches:
        jobs.append(("all-reduce", b * dense["hidden_size"] * 2, b))
    for b in args.batches if moe else []:
        jobs.append(("all-to-all", b * moe["num_experts_per_tok"] * moe["hidden_size"] * 2, b))
    if sweep:
        jobs += [(op, size, None) for op in ("all-reduce", "all-to-all")
                 for size in sweep_sizes(args)]
    records = []
    for g in groups:
        for op, nbytes, batch in jobs:
            if op == "all-to-all" and batch:  # tokens are split over the group first
                nbytes = -(-batch // g) * nbytes // batch
            head = dict(kind="collective", part=part, model=op, op=op, group=g, gpus=g, dp=1,
                        tp=g if op == "all-reduce" else 1, ep=g if op == "all-to-all" else 1,
                        batch=batch, bytes=nbytes, purpose="decode, per layer" if batch else
                        "sweep")
            if late(args):
                records.append(dict(head, skipped="time limit"))
                continue
            try:
                records.append(dict(head, **time_collective(args, op, nbytes, devices[:g])))
            except Exception as e:
                records.append(dict(head, error=f"{type(e).__name__}: {e}"[:1000]))
            r = records[-1]
            if batch and "us_per_op" in r:
                r["calls_per_layer"] = 2
                r["step_ms_per_layer"] = round(2 * r["us_per_op"] / 1e3, 5)
            say(f"{op} x{g} {nbytes} B: " + (f"{r['us_per_op']:.1f} us an op, one call alone "
                f"{r['single_call_us']:.1f} us" if "us_per_op" in r else
                r.get("error") or r.get("skipped")))
    return records


def time_collective(args, op, nbytes, devices):
    """Microseconds of one collective: from a jit of `reps` chained ops against a jit of one
    ((t(reps) - t(1)) / (reps - 1)), so the call's own dispatch and wait cancel out; and the
    one-op jit alone, as a lone collective costs the host."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pallasite.sharding.parallel import shard_map
    g = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    elems = max(g, -(-nbytes // 2 // g) * g)  # bf16 per device, a multiple of g for all-to-all
    x = jax.device_put(jnp.zeros((g * elems,), jnp.bfloat16), NamedSharding(mesh, P("x")))
    reps = 5 if args.tiny else 20 if nbytes <= 1 << 20 else 8 if nbytes <= 16 << 20 else 3

    def chain(n):
        def body(v):
            for _ in range(n):
                v = (jax.lax.psum(v, "x") if op == "all-reduce" else
                     jax.lax.all_to_all(v, "x", 0, 0, tiled=True))
            return v
        f = shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        exe = jax.jit(f).lower(x).compile()
        times = []
        for i in range(9):
            t = time.perf_counter()
            jax.block_until_ready(exe(x))
            if i >= 2:
                times.append(1e6 * (time.perf_counter() - t))
        return float(np.median(times))

    one, many = chain(1), chain(reps)
    per_op = max(many - one, 0.0) / (reps - 1)
    return dict(reps=reps, single_call_us=round(one, 2), us_per_op=round(per_op, 2),
                algbw_GBps=round(nbytes / per_op / 1e3, 2) if per_op > 0 else None)


# -- what the compiled step and a device trace say -----------------------------------------------

HLO_LINE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
COLLECTIVE_OPS = ("all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                  "all-to-all", "ragged-all-to-all", "collective-permute",
                  "collective-permute-start", "reduce-scatter")
NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "all-reduce-done",
             "all-gather-done", "collective-permute-done", "async-done", "copy-done"}


def hlo_computations(text: str) -> dict:
    """{computation name: (is entry, [(name, type, opcode, rest), ...])} of an HLO module text."""
    comps, current = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = re.match(r"(ENTRY\s+)?%?([\w.\-]+)", line)
            current = comps.setdefault(m.group(2), (bool(m.group(1)), []))[1] if m else None
        elif current is not None and (m := HLO_LINE.match(line)):
            current.append(m.groups())
    return comps


def hlo_stats(text: str) -> dict:
    """Collectives in the compiled step (async or sync, work scheduled between start and done),
    and the kernel launches of the entry and its command buffers (CUDA graphs)."""
    comps = hlo_computations(text)
    ops = collections.Counter(op for _, lines in comps.values() for _, _, op, _ in lines
                              if op in COLLECTIVE_OPS)
    starts = [(t, rest) for _, lines in comps.values() for _, t, op, rest in lines
              if op == "all-reduce-start"]
    launches, overlapped = collections.Counter(), 0
    for name, (entry, lines) in comps.items():
        if not (entry or "command_buffer" in name):
            continue
        launches.update(op for _, _, op, _ in lines if op not in NO_LAUNCH)
        for i, (start, _, op, _) in enumerate(lines):
            if op.endswith("-start"):
                done = next((j for j, l in enumerate(lines[i:], i) if l[2].endswith("-done")
                             and l[3].startswith(f"%{start})")), i)
                overlapped += any(l[2] not in NO_LAUNCH for l in lines[i + 1:done])
    shapes = collections.Counter(t for _, lines in comps.values() for _, t, op, _ in lines
                                 if op in ("all-reduce", "all-reduce-start"))
    return dict(collectives=dict(ops), all_reduce_shapes=dict(shapes.most_common(3)),
                all_reduce_start_is_sync=sum('"is_sync":true' in r.replace(" ", "")
                                             for _, r in starts),
                async_with_work_between=overlapped, launches=sum(launches.values()),
                launch_ops=dict(launches.most_common(6)),
                command_buffers=sum("command_buffer" in n for n in comps))


KERNEL_KINDS = [("collective", re.compile(r"nccl|all_?reduce|all-reduce|one_?shot|two_?shot|"
                                          r"collective|all_?to_?all|all_?gather", re.I)),
                ("memcpy", re.compile(r"memcpy|memset", re.I)),
                ("attention", re.compile(r"attention|attn|paged|flash", re.I)),
                ("gemm", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|sm90|matmul|dot", re.I))]


def device_profile(run, steps=5) -> dict:
    """`steps` pipelined calls of `run` under the profiler: per step, the kernels on GPU 0 by
    kind (calls, microseconds), the time from the first kernel's start to the last one's end,
    and how much of it no kernel ran (launch gaps, waits on the other GPU or the host)."""
    import jax
    run(2)
    folder = tempfile.mkdtemp(prefix="bench_sharding_trace_")
    try:
        jax.profiler.start_trace(folder)
        t = time.perf_counter()
        run(steps)
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(paths[0])
        plane = next((p for p in data.planes if p.name.startswith("/device:GPU:0")), None)
        if plane is None:
            return dict(note="no GPU plane in the trace", planes=[p.name for p in data.planes])
        events = [(e.name, e.start_ns, e.duration_ns) for line in plane.lines
                  if line.name.startswith("Stream") for e in line.events]
        if not events:
            return dict(note="no kernels on GPU 0", lines=[l.name for l in plane.lines])
        return dict(kernel_summary(events, steps), wall_ms_per_step=round(1e3 * wall / steps, 4))
    except Exception as e:  # a trace is a diagnosis; its absence must not lose the timings
        return dict(error=f"{type(e).__name__}: {e}"[:500])
    finally:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


def kernel_summary(events, steps) -> dict:
    events.sort(key=lambda e: e[1])
    busy, end = 0.0, -math.inf
    for _, start, duration in events:  # length of the union of the kernels' intervals
        busy += max(0.0, start + duration - max(start, end))
        end = max(end, start + duration)
    span = end - events[0][1]
    kinds, names = collections.defaultdict(lambda: [0, 0.0]), collections.Counter()
    for name, _, duration in events:
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        kinds[kind][0] += 1
        kinds[kind][1] += duration
        names[name[:70]] += duration
    us = lambda ns: round(ns / steps / 1e3, 2)
    return dict(steps=steps, kernels_per_step=round(len(events) / steps, 1),
                device_span_us_per_step=us(span), busy_us_per_step=us(busy),
                idle_us_per_step=us(span - busy),
                by_kind={k: dict(calls=round(c / steps, 1), us=us(t),
                                 us_per_call=round(t / c / 1e3, 2)) for k, (c, t) in kinds.items()},
                top_kernels=[(n, us(t)) for n, t in names.most_common(6)])


# -- tables ---------------------------------------------------------------------------------------

def fmt(value, spec, width):
    return f"{'' if value is None else format(value, spec):>{width}}"


def step_table(records) -> list:
    rows = ["model                mesh  step          ms/step    piped  ms/layer  full-model ms"
            "  speedup  max|dlogit|"]
    for r in records:
        if r.get("kind") != "step" or r.get("part") != "main":
            continue
        if "step_ms" not in r:
            rows.append(f"{r['model']:<20} {r['mesh']:<5} {r.get('skipped') or r.get('error')}"
                        [:140])
            continue
        full = f"{r['step_ms_full_layers']:.1f} ({r['full_layers']}L)"
        rows.append(f"{r['model']:<20} {r['mesh']:<5} {r['step']:<12} {r['step_ms']:>8.3f} "
                    f"{r['pipelined_ms']:>8.3f} {r['step_ms_per_layer']:>9.4f} {full:>14} "
                    f"{fmt(r.get('speedup_vs_tp1'), '.2f', 7)}x "
                    f"{fmt(r.get('max_abs_logit_diff'), '.3g', 11)}")
    return rows


def collective_table(records) -> list:
    rows = ["op          group     bytes  batch  1 call us  us/op     GB/s"]
    for r in records:
        if r.get("kind") != "collective" or r.get("part") == "variant":
            continue
        tail = (f"{r['single_call_us']:>10.1f} {r['us_per_op']:>6.1f} "
                f"{fmt(r.get('algbw_GBps'), '.1f', 8)}" if "us_per_op" in r else
                f"  {r.get('skipped') or r.get('error')}"[:80])
        rows.append(f"{r['op']:<11} {r['group']:>5} {r['bytes']:>9} {fmt(r['batch'], 'd', 6)} "
                    + tail)
    return rows


def variant_table(records) -> list:
    """One row a variant and tensor size: the batch-1 step, its all-reduce alone, its trace."""
    rows = ["variant                 tp  ms/step    piped  ms/layer  vs tp=1  vs default"
            "  AR us  kernels  coll us  idle us"]
    for r in records:
        if r.get("kind") == "variant" and ("error" in r or "skipped" in r):
            rows.append(f"{r['variant']:<22}  {r.get('skipped') or r.get('error')}"[:160])
        if r.get("kind") != "step" or r.get("part") != "variant" or "step_ms" not in r:
            continue
        ar = next((c["us_per_op"] for c in records if c.get("variant") == r["variant"]
                   and c.get("part") == "variant" and c.get("batch") == 1
                   and c.get("group") == r["tp"] and "us_per_op" in c), None)
        prof = r.get("profile") or {}
        coll = (prof.get("by_kind") or {}).get("collective", {}).get("us")
        rows.append(f"{r['variant']:<22} {r['tp']:>3} {r['step_ms']:>8.3f} "
                    f"{r['pipelined_ms']:>8.3f} {r['step_ms_per_layer']:>9.4f} "
                    f"{fmt(r.get('speedup_vs_tp1'), '.2f', 7)}x "
                    f"{fmt(r.get('speedup_vs_default'), '.2f', 10)}x {fmt(ar, '.1f', 6)} "
                    f"{fmt(prof.get('kernels_per_step'), '.0f', 8)} {fmt(coll, '.1f', 8)} "
                    f"{fmt(prof.get('idle_us_per_step'), '.1f', 8)}")
    return rows


def tables(records, goals) -> str:
    verdict = "; ".join(f"{k} at batch 1: {fmt(v['speedup'], '.2f', 0) or 'not run'}"
                        f"{'x' if v['speedup'] else ''} (goal {v['goal']}x"
                        f"{'' if v['met'] is None else ', met' if v['met'] else ', not met'})"
                        for k, v in goals.items())
    return "\n".join(["", "Decode steps (main part)", *step_table(records), "",
                      "Collectives alone", *collective_table(records), "",
                      "All-reduce variants: tp batch-1 decode (AR us: all-reduce alone at the "
                      "batch-1 size; kernels, coll us, idle us: device trace of GPU 0, a step)",
                      *variant_table(records), "", f"{DENSE}: {verdict}"])


if __name__ == "__main__":
    sys.exit(main())
