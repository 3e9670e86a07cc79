"""Where an engine step's host time goes on the GPU, part by part, under XLA's command-buffer
settings (Llama-3-8B shapes, random weights, through `LLM`).

    python -m benchmarks.dispatch --out DIR            # GPU: one child process per variant
    python -m benchmarks.dispatch --out DIR --tiny     # CPU dry run

Each variant is `weights:flags` (weights bf16, fp8 or w4a16, with `+fp8kv` for float8 KV pages;
flags names in FLAGS joined by `+`, set as XLA_FLAGS in a fresh process, since XLA reads them once;
`thread` and `nothread` launch each step on the engine's launch thread or not; a GPU's default is
on). In it, batch-1 decode through `LLM.stream` and a 64-sequence (`--batch`) `LLM.generate` run
with every part of `Engine.step` timed on the host: scheduling, packing, the forward program's
call, the sampler's call, accepting the samples, and the step's host time as the engine counts it
(its device wait taken out). A call's time is what the host spends launching it: the device runs
behind it. The `_idle` cases (`--cases`) run the same with each step collected before the next is
launched, so every launch finds the device idle. The 64 sequences' greedy tokens are recorded as a
digest, the same in every variant that computes right. `--host-trace` also lists the host's traced
events a step of each case (PJRT, the command buffers' update and launch). `--why-updates` keeps
XLA's log of each command-buffer update (level 3 of `command_buffer_thunk`: how many allocations
moved, and after how many calls) in the record, and the forward programs' buffer assignments under
OUT/buffers (the rest of XLA's dump is dropped). Records go to OUT/dispatch.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# XLA_FLAGS per variant. XLA captures runs of kernels into CUDA graphs ("command buffers") by
# default; "none" launches every kernel from the host, "all" also captures lone kernels.
FLAGS = {
    "default": "",
    "none": "--xla_gpu_enable_command_buffer=",
    "all": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
           "--xla_gpu_graph_min_graph_size=1",
    # the graphs keep the addresses of buffers that stay put after a few calls (XLA maps them
    # at fixed virtual addresses), so a call updates only the commands of those that moved
    "skip": "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED",
    # only the temporaries' buffer is mapped at one fixed virtual address
    "skip_temp": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    # a graph's independent commands are branches the GPU may run side by side
    "concurrent": "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
    # every command after the one before it: a straight-line graph, which recent CUDA drivers
    # launch in constant time rather than a time per node
    "serialize": "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE",
    # each kernel may start while the one before it finishes (programmatic dependent launch)
    "pdl": "--xla_gpu_enable_pdl=true",
    # no XLA flag: the engine's launch thread on, or off (ENVS; on by default on a GPU)
    "thread": "",
    "nothread": "",
}
# The engine's own options a variant sets (serving/launcher.py: each step launched on a thread
# of its own, beside the accepting of the step before).
ENVS = {"thread": {"PALLASITE_LAUNCH_THREAD": "1"}, "nothread": {"PALLASITE_LAUNCH_THREAD": "0"}}
PARTS = ("schedule", "pack", "forward_call", "sampler_call", "dispatch", "accept")


def timed(fn, into: list):
    def call(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - t)
        return out
    return call


def instrument(engine):
    """Wrap the engine's parts (compiled programs included) to record each call's host time.
    Returns the times by part and a function that puts the unwrapped programs back."""
    times = {p: [] for p in PARTS}
    engine.scheduler.schedule_step = timed(engine.scheduler.schedule_step, times["schedule"])
    engine.batch.pack = timed(engine.batch.pack, times["pack"])
    engine._dispatch = timed(engine._dispatch, times["dispatch"])
    engine._accept = timed(engine._accept, times["accept"])
    tables = ((engine._exe, "forward_call"), (engine._samplers, "sampler_call"))
    saved = [dict(table) for table, _ in tables]
    for table, part in tables:
        for key, exe in list(table.items()):
            table[key] = timed(exe, times[part])

    def restore():
        for (table, _), old in zip(tables, saved):
            table.update(old)
        for obj, name in ((engine.scheduler, "schedule_step"), (engine.batch, "pack"),
                          (engine, "_dispatch"), (engine, "_accept")):
            del obj.__dict__[name]  # the class's method again
    return times, restore


def summary(times: dict, engine, steps0: int, host0: float) -> dict:
    steps = engine.totals["steps"] - steps0
    out = {f"{p}_us": 1e6 * float(np.median(v)) for p, v in times.items() if v}
    out["host_ms_per_step"] = 1e3 * (engine.totals["host_s"] - host0) / max(steps, 1)
    out["steps"] = steps
    return out


def run_variant(tiny: bool, weights: str, host_trace: bool = False, batch: int = 64,
                table_pages: int | None = None, pool_pages: int = 0,
                cases: str = "batch1,batchN,batch1_idle,batchN_idle") -> list[dict]:
    import jax
    import jax.numpy as jnp
    from benchmarks.bench_quant import LLAMA3_8B, TINY
    from pallasite.model import config_from_dict, init_params, quant
    from pallasite.serving.llm import LLM, SamplingParams

    config = config_from_dict(TINY if tiny else LLAMA3_8B)
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    weights, _, kv = weights.partition("+")  # e.g. "bf16+fp8kv": float8 KV pages too
    if weights == "fp8":
        params = quant.quantize_params(params)
    elif weights == "w4a16":  # random INT4 g128 words made on the device, as bench_int4's
        from benchmarks.bench_int4 import random_w4a16
        params = random_w4a16(params)
    prompt_len, new, batch = (16, 16, 4) if tiny else (128, 128, batch)
    seq_pages = -(-(prompt_len + new) // 16)
    pages = table_pages or seq_pages  # the page table's width
    budget = max(prompt_len, batch)  # tokens a step: a prompt, or a row for every sequence
    llm = LLM.from_params(config, params, None, max_num_seqs=batch,
                          max_num_batched_tokens=budget,
                          num_pages=max(batch * seq_pages + 8, pool_pages),
                          token_buckets=sorted({1, 2, batch, budget}), page_buckets=[pages],
                          max_model_len=max(prompt_len + new, 16 * pages),
                          kv_cache_dtype="fp8" if kv == "fp8kv" else "auto")
    del params
    engine = llm.engine
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt_len)).tolist()
    sampling = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sampling)  # compiles whatever warm-up left cold
    list(llm.stream(prompts[0], sampling))
    records = []
    # "_idle": each step collected before the next is launched (overlap off), so the launch
    # finds the device idle: a launch that takes longer with the device busy is waiting on it
    for case in cases.replace("batchN", f"batch{batch}").split(","):
        engine.overlap = not case.endswith("_idle")
        times, restore = instrument(engine)
        steps0, host0 = engine.totals["steps"], engine.totals["host_s"]
        t = time.perf_counter()
        if case.split("_")[0] == "batch1":
            stamps = [time.perf_counter() for _ in llm.stream(prompts[0], sampling)]
            step_ms, digest = 1e3 * float(np.median(np.diff(stamps[1:]))), None
        else:  # the greedy tokens' digest: the same in every variant, or a variant is wrong
            outs = llm.generate(prompts, sampling)
            digest = hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()
            step_ms = None
        rec = dict(case=case, weights=weights, kv_cache_dtype=kv or "auto",
                   wall_s=time.perf_counter() - t, stream_ms_per_token=step_ms,
                   tokens_sha256=digest,
                   **summary(times, engine, steps0, host0))
        print(json.dumps(rec), flush=True)
        records.append(rec)
        restore()
    engine.overlap = True
    if host_trace:
        steps = lambda: engine.totals["steps"]
        records.append(dict(case="host_trace", weights=weights, kv_cache_dtype=kv or "auto",
                            host_events=trace_host(lambda: list(llm.stream(prompts[0], sampling)),
                                                   steps)))
        records.append(dict(case=f"host_trace_batch{batch}", weights=weights,
                            kv_cache_dtype=kv or "auto", host_events=trace_host(
                                lambda: llm.generate(prompts, sampling), steps)))
    llm.close()
    return records


def trace_host(run, steps, top=40) -> list[dict]:
    """The host's traced events while `run()` runs engine steps (`steps()` counts them), by
    name: calls and microseconds a step, the largest first. Names nest (an executable's launch
    holds its thunks'), so the rows overlap."""
    from benchmarks import common
    steps0 = steps()
    _, data = common.traced(run)
    return events_by_name(data, steps() - steps0, top)


def events_by_name(data, steps: int, top=40) -> list[dict]:
    """A host trace's events (`ProfileData`) by name: calls and microseconds a step, the largest
    first."""
    total, calls = {}, {}
    for plane in data.planes:
        if plane.name.startswith("/device"):
            continue
        for line in plane.lines:
            for e in line.events:
                total[e.name] = total.get(e.name, 0.0) + e.duration_ns
                calls[e.name] = calls.get(e.name, 0) + 1
    rows = sorted(total, key=total.get, reverse=True)[:top]
    return [dict(name=n[:160], calls_per_step=calls[n] / steps, us_per_step=total[n] / steps / 1e3)
            for n in rows]


def update_log(stderr: str, top: int = 30) -> tuple[list[dict], list[dict]]:
    """XLA's command-buffer log lines ("Update command buffer ... updated_allocs=N"),
    addresses masked so that repeats group, with their counts: the most frequent first. The
    update times ("Updated command buffer in N μs") are summed up apart, by graph size."""
    import re
    counts, times = {}, {}
    for ln in stderr.splitlines():
        took = re.search(r"pdated command buffer in (\d+) μs; num_commands=(\d+)", ln)
        if took:
            times.setdefault(int(took[2]), []).append(int(took[1]))
        elif "command_buffer" in ln or "ommand buffer" in ln:
            key = re.sub(r"0x[0-9a-f]+", "#", ln.split("] ", 1)[-1])[:300]
            counts[key] = counts.get(key, 0) + 1
    lines = [dict(line=k, count=n) for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    updates = [dict(num_commands=n, updates=len(t), median_us=float(np.median(t)),
                    p90_us=float(np.percentile(t, 90)), max_us=max(t))
               for n, t in sorted(times.items())]
    return lines[:top], updates


def keep_buffer_assignments(dump: Path, to: Path):
    """Move the buffer assignments of XLA's dump to `to` and drop the rest of the dump."""
    import shutil
    to.mkdir(parents=True, exist_ok=True)
    for f in dump.glob("*buffer-assignment.txt"):
        shutil.move(str(f), to / f.name)
    shutil.rmtree(dump, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU dry run)")
    p.add_argument("--variants", default="bf16:default,fp8:default,fp8:none,fp8:all")
    p.add_argument("--batch", type=int, default=64,
                   help="sequences of the many-sequence case (past 128, every step is that many "
                        "tokens, as a paced offline step)")
    p.add_argument("--table-pages", type=int, default=None,
                   help="the page table's width in pages (ShareGPT's engine: 128)")
    p.add_argument("--pool-pages", type=int, default=0,
                   help="KV pages in the pool, at least (ShareGPT's engine: about 19,000)")
    p.add_argument("--cases", default="batch1,batchN,batch1_idle,batchN_idle",
                   help="timed cases (batchN: --batch sequences; _idle: each step collected "
                        "before the next launch)")
    p.add_argument("--host-trace", action="store_true",
                   help="also trace batch-1 decode and the many-sequence case, and list the "
                        "host's events by name")
    p.add_argument("--why-updates", action="store_true",
                   help="log XLA's CUDA-graph updates, and keep the buffer assignments")
    p.add_argument("--child-timeout", type=float, default=None,
                   help="seconds a variant may run; its log so far is kept when it runs past")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        weights, flags = args.child.split(":")
        from benchmarks import common
        recs = [common.run_info() | r | dict(xla_flags=flags)
                for r in run_variant(args.tiny, weights, args.host_trace, args.batch,
                                     args.table_pages, args.pool_pages, args.cases)]
        print("RECORDS " + json.dumps(recs), flush=True)
        return
    from benchmarks import common
    records = []
    head = common.run_info(device=False) | dict(model="tiny" if args.tiny else "llama3-8b-shaped")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        flags = variant.split(":")[1]
        env = dict(os.environ)
        names = flags.split("+")  # e.g. "serialize+thread"
        xla = " ".join(f for f in [env.get("XLA_FLAGS", "")] + [FLAGS[n] for n in names] if f)
        if args.why_updates:
            dump = Path(args.out) / "xla_dump" / variant.replace(":", "_")
            xla += f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=forward"
            env.update(TF_CPP_VMODULE="command_buffer_thunk=3", TF_CPP_MIN_LOG_LEVEL="0")
        if xla.strip():
            env["XLA_FLAGS"] = xla.strip()
        for n in names:
            env.update(ENVS.get(n, {}))
        cmd = [sys.executable, "-m", "benchmarks.dispatch", "--child", variant]
        t = time.time()
        cmd += ["--tiny"] * args.tiny + ["--host-trace"] * args.host_trace
        cmd += ["--batch", str(args.batch), "--pool-pages", str(args.pool_pages),
                "--cases", args.cases]
        cmd += ["--table-pages", str(args.table_pages)] * bool(args.table_pages)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.child_timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:  # keep what it logged so far
            rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
            stdout, stderr = (x.decode() if isinstance(x, bytes) else x for x in (stdout, stderr))
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RECORDS ")]
        print(f"{variant}: rc {rc}, {time.time() - t:.0f} s", flush=True)
        if args.why_updates:
            log, updates = update_log(stderr)
            records.append(dict(case="update_log", weights=variant, lines=log, updates=updates))
            keep_buffer_assignments(dump, Path(args.out) / "buffers" / dump.name)
        if not lines:
            print(stdout[-2000:], stderr[-3000:], flush=True)
            continue
        for r in json.loads(lines[-1][len("RECORDS "):]):
            print("  " + json.dumps(r), flush=True)
            records.append(r)
        # written after each variant, so that a run cut short keeps the variants it finished;
        # the children's records name the GPU and JAX version, the command is this one
        (out / "dispatch.json").write_text(json.dumps([r | head for r in records], indent=1))
    for r in records:
        if r["case"] == "update_log":
            print(f"{r['weights']} command-buffer log:")
            for e in r["lines"]:
                print(f"  {e['count']:6d}  {e['line']}")
            for u in r["updates"]:
                print(f"  graph of {u['num_commands']} commands: {u['updates']} updates, median "
                      f"{u['median_us']:.0f} us, p90 {u['p90_us']:.0f}, max {u['max_us']}")
            continue
        if r["case"].startswith("host_trace"):
            print(f"{r['weights']}:{r['xla_flags']} {r['case']}: host events a step:")
            for e in r["host_events"]:
                print(f"  {e['us_per_step']:9.1f} us {e['calls_per_step']:7.1f} calls  {e['name']}")
            continue
        parts = ", ".join(f"{k[:-3]} {r[k]:.0f}" for k in r if k.endswith("_us"))
        tok = f"{r['stream_ms_per_token']:.2f} ms/token; " if r["stream_ms_per_token"] else ""
        print(f"{r['weights']}:{r['xla_flags']} {r['case']}: {tok}host {r['host_ms_per_step']:.2f}"
              f" ms/step; us: {parts}")


if __name__ == "__main__":
    main()
