"""What the sharding benchmark reads from a compiled step (its HLO: collectives, kernels
launched) and from a device trace (collective kernels, other kernels, idle gaps), and its tables."""

from __future__ import annotations

import collections
import glob
import math
import os
import re
import tempfile
import time

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


def tables(records, goals, model: str) -> str:
    """The three tables, then whether `model` met its speed-up goals."""
    verdict = "; ".join(f"{k} at batch 1: {fmt(v['speedup'], '.2f', 0) or 'not run'}"
                        f"{'x' if v['speedup'] else ''} (goal {v['goal']}x"
                        f"{'' if v['met'] is None else ', met' if v['met'] else ', not met'})"
                        for k, v in goals.items())
    return "\n".join(["", "Decode steps (main part)", *step_table(records), "",
                      "Collectives alone", *collective_table(records), "",
                      "All-reduce variants: tp batch-1 decode (AR us: all-reduce alone at the "
                      "batch-1 size; kernels, coll us, idle us: device trace of GPU 0, a step)",
                      *variant_table(records), "", f"{model}: {verdict}"])
