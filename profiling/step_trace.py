"""What a `jax.profiler` trace of the decode step says: device ops per step, matched to the
compiled HLO (op name, fused ops, JAX op_name) to be put in a category, and the time per
category, per kernel and in gaps."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np

CATEGORIES = ["matmul", "logits/lm_head", "attention kernel", "split-K merge", "attention glue",
              "KV write", "norm/RoPE/elementwise", "sampler", "copy/memset", "other"]


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
