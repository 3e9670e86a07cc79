"""Every plan of a model on a cluster, evaluated (memory, then performance at the batches that
fit), ranked, and written as JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from ...model import ModelConfig
from ...sharding import MeshPlan, PlanError, validate_plan
from .inputs import CONSTANTS, GIB, INT_BYTES, Cluster, Workload
from .model import Step, decode_step, memory, prefill_step, shapes_of


def enumerate_plans(config: ModelConfig, num_gpus: int) -> list[MeshPlan]:
    """Every (data, tensor, expert) split of exactly `num_gpus` devices."""
    out = []
    for t in range(1, num_gpus + 1):
        for e in range(1, num_gpus // t + 1):
            if num_gpus % (t * e) == 0:
                out.append(MeshPlan(num_gpus // (t * e), t, e))
    return out


def batch_sizes(limit: int) -> list[int]:
    sizes = [b for b in (2 ** i for i in range(20)) if b <= limit]
    return sizes + ([limit] if limit > 0 and limit not in sizes else [])


def evaluate(config: ModelConfig, plan: MeshPlan, cluster: Cluster, wl: Workload) -> dict:
    """Everything the explorer reports for one plan; `status` is ok, invalid or no-fit."""
    rec = dict(plan=str(plan), data=plan.data, tensor=plan.tensor, expert=plan.expert)
    try:
        validate_plan(config, plan, cluster.num_gpus)
    except PlanError as err:
        return rec | dict(status="invalid", reason=str(err))
    if wl.quantization in INT_BYTES and plan.tensor * plan.expert > 1:
        return rec | dict(status="invalid", reason=(
            f"{wl.quantization} weights load whole on each device (the loader does not split "
            "integer weights): use tensor=1, expert=1"))
    shapes = shapes_of(config, plan)
    mem = memory(config, shapes, plan, cluster, wl)
    rec["memory_gib"] = mem.to_dict()
    if mem.kv_seqs < 1:
        need = mem.weights + mem.workspace + (-(-wl.max_len // wl.page_size)) * wl.page_size * \
            mem.kv_per_token
        short = need - mem.budget
        return rec | dict(status="no-fit", short_gib=round(short / GIB, 3), reason=(
            f"needs {need / GIB:.2f} GiB per GPU (weights {mem.weights / GIB:.2f}, workspace "
            f"{mem.workspace / GIB:.2f}, one {wl.max_len}-token sequence of KV) but "
            f"{mem.budget / GIB:.2f} GiB is usable: {short / GIB:.2f} GiB short"))
    rec.update(status="ok", **_performance(config, shapes, plan, cluster, wl, mem))
    return rec


def _step_dict(s: Step) -> dict:
    return dict(ms=s.time * 1e3, bound=s.bound, flops=s.mm_flops + s.attn_flops,
                hbm_bytes=s.hbm_bytes, mem_ms=s.t_mem * 1e3, compute_ms=s.t_compute * 1e3,
                comm_ms=s.t_comm * 1e3, overhead_ms=s.t_fixed * 1e3,
                comm_per_layer={k: dict(bytes=b, us=t * 1e6) for k, (b, t) in s.comm.items()})


def _performance(config, shapes, plan, cluster, wl, mem) -> dict:
    args = (config, shapes, plan, cluster, wl)
    p = int(wl.prompt.mean)
    prefill = prefill_step(*args, 1, p)
    # Per-token prefill costs, from a full chunk (what a loaded server runs).
    per_chunk = max(1, wl.chunk // p)
    chunk = prefill_step(*args, per_chunk, p)
    prefill_tok_s = chunk.time / (per_chunk * p)
    cap = mem.kv_tokens // max(1, math.ceil(wl.mean_context + wl.output.mean / 2))
    if wl.concurrency:
        cap = min(cap, max(1, wl.concurrency // plan.data))
    ttft = prefill.time + decode_step(*args, 1, p).time
    curve = []
    for b in batch_sizes(max(1, cap)):
        dec = decode_step(*args, b, wl.mean_context)
        # Steady state: every step also prefills the prompts of the b/output requests that
        # replace the finished ones, so prompts slow the step down.
        tpot = dec.time + b / wl.output.mean * p * prefill_tok_s
        curve.append(dict(batch=b, decode_ms=dec.time * 1e3, tpot_ms=tpot * 1e3,
                          tok_s=plan.data * b / tpot, bound=dec.bound))
    meets = [c for c in curve if wl.tpot_ms is None or c["tpot_ms"] <= wl.tpot_ms]
    best = max(meets, key=lambda c: c["tok_s"]) if meets else None
    rate_ok = None
    if wl.rate is not None:
        rate_ok = best is not None and best["tok_s"] >= wl.rate * wl.output.mean
    sla_ok = (wl.ttft_ms is None or ttft * 1e3 <= wl.ttft_ms) and best is not None
    d1 = decode_step(*args, 1, wl.mean_context)
    return dict(
        params_total=shapes.total, params_per_gpu=shapes.device_total,
        prefill=_step_dict(prefill) | dict(tokens=p, per_token_flops=prefill.mm_flops / p,
                                           per_token_hbm_bytes=prefill.hbm_bytes / p),
        ttft_ms=ttft * 1e3, prefill_ms_per_token_loaded=prefill_tok_s * 1e3,
        decode_batch1=_step_dict(d1), compute_bound_batch=_compute_bound_batch(args, wl.mean_context),
        compute_bound_batch_weights_only=_compute_bound_batch(args, 0),
        max_batch=cap, curve=curve, best=best, sla_ok=sla_ok, rate_ok=rate_ok,
        max_tok_s=max(c["tok_s"] for c in curve))


def _compute_bound_batch(args, context: float) -> int | None:
    """Smallest decode batch whose compute time reaches its memory time, at `context` cached
    tokens per sequence. None when it never does: each sequence's K/V reads then grow faster
    than its FLOPs (GQA attention does ~q_per_kv FLOPs per byte read)."""
    def compute_bound(b):
        s = decode_step(*args, b, context)
        return s.t_compute >= s.t_mem
    lo, hi = 1, 2 ** 20
    if not compute_bound(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not compute_bound(mid) else (lo, mid)
    return lo


def rank(records: list[dict]) -> list[dict]:
    """Fitting plans first: SLA met, then throughput at the best SLA batch, then TTFT; then the
    ones that do not fit, then the invalid ones."""
    def key(r):
        if r["status"] != "ok":
            return (2 if r["status"] == "no-fit" else 3, 0, 0)
        tok = r["best"]["tok_s"] if r["best"] else 0
        return (0 if r["sla_ok"] else 1, -tok, r["ttft_ms"])
    return sorted(records, key=key)


def explore(config: ModelConfig, cluster: Cluster, wl: Workload, plans=None) -> list[dict]:
    plans = plans or enumerate_plans(config, cluster.num_gpus)
    return rank([evaluate(config, p, cluster, wl) for p in plans])


def to_json(config: ModelConfig, cluster: Cluster, wl: Workload, records) -> str:
    head = dict(schema=1, model=config.name or config.model_type, params=None,
                gpu=cluster.gpu.name, gpus_per_host=cluster.gpus_per_host, hosts=cluster.hosts,
                workload=dataclasses.asdict(wl),
                constants={k: dict(value=v, source=s) for k, (v, s) in CONSTANTS.items()})
    ok = [r for r in records if r["status"] == "ok"]
    head["params"] = ok[0]["params_total"] if ok else None
    return json.dumps(head | dict(plans=records), indent=1, default=_plain)


def _plain(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return str(x)
