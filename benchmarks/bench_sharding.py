"""Sharding benchmark: decode step time of a model split over 1, 2, 4 GPUs, the collectives it
uses measured alone, and cheaper all-reduce settings tried side by side.

    python -m benchmarks.bench_sharding --out DIR --time-limit 270   # every GPU this machine has
    python -m benchmarks.bench_sharding --tiny --out DIR    # tiny shapes, 8 fake CPU devices

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
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from .sharding_report import tables
from .sharding_steps import (DENSE, MOE, collective_records, dense_layers, late, measure_model,
                             models, say)

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
    from .common import command  # here: the parent imports no JAX before its children start
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
                  command=command(),
                  args={k: v for k, v in vars(args).items() if k not in ("argv", "child")},
                  parts=parts, wall_s=round(time.time() - started, 1),
                  targets=targets(records), records=records)
    path = os.path.join(args.out, "sharding.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    nccl = next((p["nccl_version"] for p in parts.values() if p.get("nccl_version")), None)
    print(f"\n{result['gpu']} x{result['gpus']}, JAX {result['jax_version']}, NCCL {nccl}, "
          f"{result['wall_s']} s; records in {path}")
    print(tables(records, result["targets"], DENSE))


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


if __name__ == "__main__":
    sys.exit(main())
