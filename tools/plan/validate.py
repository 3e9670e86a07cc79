"""Checks the plan explorer's predictions against measured runs of the real model.

For each (model, plan) group it compiles the model's paged `forward` for every point first, on
an empty device (so XLA's autotuning scratch never sits on top of the weights), then creates
random bf16 weights one tensor at a time straight onto their shards, a paged KV cache
(`sharding.Layout`), and times prefill steps (B prompts of P tokens in one step) and decode
steps (B sequences with C cached tokens, one new token each), reading the device's memory after
each point. Models are the presets with fewer layers (named e.g. "llama-3-8b-8L").

    python -m pallasite.tools.plan.validate --devices 1 --time-limit 260 --out $OUT  # 1 GPU, ~3 min
    python -m pallasite.tools.plan.validate --devices 2 --time-limit 170 --out $OUT  # 2 GPUs
    python -m pallasite.tools.plan.validate --tiny --out /tmp/pv   # 8 fake CPU devices
    python -m pallasite.tools.plan.validate --repredict OLD.json ...   # no GPU: today's predictions

Each group runs in its own process, so the device's `peak_bytes_in_use` (which never resets) is
that group's; points run in order of XLA's own size of their step (temp + outputs), so the peak
read after a point is that point's. A first process measures what the constants need and no
validation point may set: the copy bandwidth (torch `copy_`) and, on 2 GPUs, the time of an
all-reduce in a chain of them at decode and prefill sizes.

Records go to OUT/plan_validation.json: model, plan, batch, phase, length, tokens, predicted_ms,
measured_ms, rel_error, predicted_bound, predicted_peak_gb, measured_peak_gb, the peak's parts
(weights_gb, kv_gb, live_gb, temp_gb, output_gb, xla_peak_gb, compile_peak_gb, init_peak_gb,
predicted_act_gb), gpu, date, jax_version, command; one record with kind "microbench".
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # fake CPU devices: must be set before JAX is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import json
import subprocess
import time

import numpy as np

from .measure import MICRO, run_group, run_micro
from .predict import gpu_key, predict, predict_peak

# (model, layers, plan, [(phase, batch, length)]): length is the prompt (prefill) or the cached
# context (decode). Each device count starts with the microbenchmarks, then the groups in order
# of importance (a run out of time skips the last).
GPU_GROUPS = {
    1: [(MICRO, None, "dp=1,tp=1,ep=1", []),
        ("llama-3-8b", 8, "dp=1,tp=1,ep=1",
         [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024),
          ("prefill", 1, 1024), ("prefill", 4, 1024)]),
        ("qwen3-30b-a3b", 8, "dp=1,tp=1,ep=1",
         [("decode", 1, 1024), ("decode", 8, 1024), ("decode", 32, 1024),
          ("prefill", 1, 1024), ("prefill", 2, 1024)]),
        ("qwen3-32b", 8, "dp=1,tp=1,ep=1",
         [("decode", 1, 1024), ("decode", 32, 1024), ("prefill", 1, 1024)])],
    2: [(MICRO, None, "dp=1,tp=2,ep=1", []),
        ("llama-3-8b", 8, "dp=1,tp=2,ep=1",
         [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024),
          ("prefill", 1, 1024), ("prefill", 4, 1024)]),
        ("qwen3-30b-a3b", 8, "dp=1,tp=1,ep=2",
         [("decode", 1, 1024), ("decode", 32, 1024), ("prefill", 1, 1024)]),
        ("qwen3-30b-a3b", 8, "dp=1,tp=2,ep=1",
         [("decode", 32, 1024), ("prefill", 1, 1024)]),
        # the same steps on one of the two GPUs: what tp=2 changes, on the same chip
        ("llama-3-8b", 8, "dp=1,tp=1,ep=1",
         [("decode", 1, 1024), ("decode", 16, 1024), ("prefill", 1, 1024)])],
}

TINY_GROUPS = {
    1: [(MICRO, None, "dp=1,tp=1,ep=1", []),
        ("tiny-dense", None, "dp=1,tp=1,ep=1", [("decode", 2, 32), ("prefill", 2, 32)])],
    2: [(MICRO, None, "dp=1,tp=2,ep=1", []),
        ("tiny-dense", None, "dp=1,tp=2,ep=1", [("decode", 2, 32), ("prefill", 1, 32)]),
        ("tiny-moe", None, "dp=1,tp=1,ep=2", [("decode", 2, 32), ("prefill", 1, 32)])],
}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, choices=(1, 2), action="append",
                    help="which device count's plans to run (repeatable; --tiny: both)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="tiny models on fake CPU devices")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds after which no group or point starts; the run ends by this "
                         "+ 60 at worst (default 260 on one GPU, 170 on two)")
    ap.add_argument("--repredict", nargs="+", metavar="JSON",
                    help="no GPU: recompute the predictions of these records' points")
    ap.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--group-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.time_limit is None:
        args.time_limit = 600 if args.tiny else (260 if args.devices in (None, [1]) else 170)
    return args


def groups_for(args) -> list:
    table = TINY_GROUPS if args.tiny else GPU_GROUPS
    counts = args.devices or ([1, 2] if args.tiny else [1])
    return [g for n in counts for g in table[n]]


def repredict(paths, out):
    """No GPU: the records of earlier runs with today's predictions (the measurements kept).
    Records without `num_pages` (runs before the peak's parts were recorded) keep their peak
    prediction."""
    records = []
    for path in paths:
        for rec in json.loads(open(path).read()):
            if "measured_ms" not in rec:
                continue
            ms, bound = predict(rec, gpu_key(rec["gpu"]))
            rec = rec | dict(predicted_ms=ms, predicted_bound=bound,
                             rel_error=(ms - rec["measured_ms"]) / rec["measured_ms"])
            if "num_pages" in rec:
                rec |= predict_peak(rec)
            records.append(rec)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_validation.json"), "w") as f:
        json.dump(records, f, indent=1)
    print(json.dumps(summary(records), indent=1))
    print_table(records)
    return 0


# -- driver --------------------------------------------------------------------------------------
def run_in_subprocess(index: int, args, deadline: float) -> list[dict]:
    out = os.path.join(args.out, f".plan_validate_group{index}.json")
    cmd = [sys.executable, "-m", "pallasite.tools.plan.validate", "--group", str(index),
           "--group-out", out, "--deadline", str(deadline)] + (["--tiny"] if args.tiny else []) + \
        [f"--devices={n}" for n in (args.devices or [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=max(10, deadline - time.time() + 60))
    except subprocess.TimeoutExpired:
        return [dict(error=f"group {index} timed out")]
    if proc.returncode != 0 or not os.path.exists(out):
        return [dict(error=f"group {index} failed (rc {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")]
    with open(out) as f:
        records = json.load(f)
    os.remove(out)
    return records


def _f(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(records):
    for r in records:
        if r.get("kind") == MICRO:
            print(f"microbench {r.get('gpu', '')} {r['plan']}: copy {r.get('copy_tbps', '-')} "
                  f"TB/s; all-reduce us by rows of {r.get('allreduce_hidden', '-')}: "
                  f"{r.get('allreduce_us', '-')} {r.get('copy_error', '')}")
    print(f"{'model':<18} {'plan':<15} {'phase':<7} {'batch':>5} {'pred ms':>8} {'meas ms':>8} "
          f"{'error':>7} {'pred GB':>7} {'meas GB':>7} {'error':>6} {'temp GB':>7}")
    for r in records:
        if r.get("kind") == MICRO:
            continue
        if "measured_ms" not in r:
            print(f"{r.get('model', '?'):<18} {r.get('plan', ''):<15} {r.get('phase', ''):<7} "
                  f"{r.get('batch', ''):>5}  {r.get('error', '')[:300]}")
            continue
        meas = r.get("measured_peak_gb")
        err = None if not meas else r["predicted_peak_gb"] / meas - 1
        print(f"{r['model']:<18} {r['plan']:<15} {r['phase']:<7} {r['batch']:>5} "
              f"{r['predicted_ms']:>8.3f} {r['measured_ms']:>8.3f} {r['rel_error']:>+7.1%} "
              f"{r['predicted_peak_gb']:>7.2f} {_f(meas, '7.2f'):>7} {_f(err, '+6.1%'):>6} "
              f"{_f(r.get('temp_gb'), '7.3f'):>7}")


def summary(records) -> dict:
    out = {}
    for phase in ("prefill", "decode"):
        errs = [abs(r["rel_error"]) for r in records if r.get("phase") == phase and "rel_error" in r]
        out[phase] = dict(points=len(errs),
                          median_abs_error=float(np.median(errs)) if errs else None)
    peaks = [abs(r["predicted_peak_gb"] / r["measured_peak_gb"] - 1) for r in records
             if r.get("measured_peak_gb") and "predicted_peak_gb" in r]
    out["peak_memory"] = dict(points=len(peaks),
                              median_abs_error=float(np.median(peaks)) if peaks else None,
                              max_abs_error=float(max(peaks)) if peaks else None)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    if args.repredict:
        return repredict(args.repredict, args.out)
    groups = groups_for(args)
    if args.group is not None:  # child: one group
        group = groups[args.group]
        if group[0] == MICRO:
            records = run_micro(group[2], args.tiny)
        else:
            records = run_group(group, args.deadline, args.tiny)
        import jax
        records = [r | dict(jax_version=jax.__version__) for r in records]
        with open(args.group_out, "w") as f:
            json.dump(records, f)
        return 0
    # The parent never touches a device: each child takes the GPUs' memory for itself.
    os.makedirs(args.out, exist_ok=True)
    deadline = time.time() + args.time_limit
    records = []
    for i, (name, layers, plan, points) in enumerate(groups):
        if time.time() > deadline:  # nothing starts after the deadline
            records += [dict(model=name, plan=plan, phase=ph, batch=b, length=n,
                             error="skipped: out of time") for ph, b, n in points]
            continue
        records += run_in_subprocess(i, args, deadline)
    stamp = dict(date=datetime.date.today().isoformat(),
                 command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    records = [r | stamp for r in records]
    path = os.path.join(args.out, "plan_validation.json")
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}")
    print(json.dumps(summary(records), indent=1))
    print_table(records)
    ok = all("measured_ms" in r or r.get("kind") == MICRO for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
