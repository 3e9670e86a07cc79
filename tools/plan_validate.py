"""Checks the plan explorer's predictions against measured runs of the real model.

For each (model, plan) group it creates random bf16 weights on the devices (a jit of
`init_params` with the plan's shardings), a paged KV cache (`sharding.Layout`), and times the
model's paged `forward` on prefill batches (B prompts of P tokens in one step) and decode steps
(B sequences with C cached tokens, one new token each), then reads the devices' peak memory.
Models are the presets with fewer layers (named e.g. "llama-3-8b-8L") so that each GPU run,
compilation included, stays within about five minutes.

    python3 tools/plan_validate.py --devices 1 --out $OUT     # one GPU
    python3 tools/plan_validate.py --devices 2 --out $OUT     # two GPUs (tensor / expert = 2)
    python3 tools/plan_validate.py --tiny                     # tiny models on 8 fake CPU devices

Each group runs in its own process, so `peak_bytes_in_use` (which never resets) is that group's.
Records go to OUT/plan_validation.json: model, plan, batch, phase, predicted_ms, measured_ms,
rel_error, predicted_peak_gb, measured_peak_gb, gpu, date, jax_version, command.
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

PAGE = 16

# (model, layers, plan, [(phase, batch, length)]): length is the prompt (prefill) or the cached
# context (decode). Points run in order of growing activations, so the peak read after each
# point is that point's.
GPU_GROUPS = {
    1: [("llama-3-8b", 8, "dp=1,tp=1,ep=1",
         [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024),
          ("prefill", 1, 1024), ("prefill", 4, 1024)]),
        ("qwen3-30b-a3b", 8, "dp=1,tp=1,ep=1",
         [("decode", 1, 1024), ("decode", 32, 1024), ("prefill", 1, 1024)])],
    2: [("llama-3-8b", 8, "dp=1,tp=2,ep=1",
         [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024),
          ("prefill", 1, 1024), ("prefill", 4, 1024)]),
        ("qwen3-30b-a3b", 8, "dp=1,tp=1,ep=2",
         [("decode", 1, 1024), ("decode", 32, 1024), ("prefill", 1, 1024)]),
        ("qwen3-30b-a3b", 8, "dp=1,tp=2,ep=1",
         [("decode", 32, 1024), ("prefill", 1, 1024)])],
}

TINY_MODELS = {
    "tiny-dense": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512),
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512),
}
TINY_GROUPS = {
    1: [("tiny-dense", None, "dp=1,tp=1,ep=1", [("decode", 2, 32), ("prefill", 2, 32)])],
    2: [("tiny-dense", None, "dp=1,tp=2,ep=1", [("decode", 2, 32), ("prefill", 1, 32)]),
        ("tiny-moe", None, "dp=1,tp=1,ep=2", [("decode", 2, 32), ("prefill", 1, 32)])],
}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, choices=(1, 2), action="append",
                    help="which device count's plans to run (repeatable; --tiny: both)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="tiny models on fake CPU devices")
    ap.add_argument("--time-limit", type=float, default=280, help="seconds for the whole run")
    ap.add_argument("--repredict", nargs="+", metavar="JSON",
                    help="no GPU: recompute the predictions of these records' points")
    ap.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--group-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def groups_for(args) -> list:
    table = TINY_GROUPS if args.tiny else GPU_GROUPS
    counts = args.devices or ([1, 2] if args.tiny else [1])
    return [g for n in counts for g in table[n]]


# -- one group, in its own process ---------------------------------------------------------------
def load(name: str, layers):
    from pallasite.model import config_from_dict
    from pallasite.tools.plan_model import load_model
    if name in TINY_MODELS:
        return config_from_dict(TINY_MODELS[name], name=name)
    return load_model(name, layers)


def gpu_key() -> str:
    import jax
    kind = jax.devices()[0].device_kind
    return "h200" if "H200" in kind else "h100"


def peak_bytes(devices) -> float | None:
    stats = [d.memory_stats() or {} for d in devices]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return max(peaks) if peaks else None


def make_batch(phase: str, batch: int, length: int, vocab: int, rng):
    """Flat tokens/positions and the `Batch` of a prefill (batch prompts of `length` tokens) or
    decode step (one token each after `length` cached ones). Sequence i owns a contiguous run of
    pages from 1 (page 0 stays the null page)."""
    from pallasite.model import Batch
    ctx = length if phase == "prefill" else length + 1
    new = length if phase == "prefill" else 1
    pages = -(-ctx // PAGE)
    table = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    pos = np.tile(np.arange(ctx - new, ctx, dtype=np.int32), batch)
    seq = np.repeat(np.arange(batch), new)
    slots = table[seq, pos // PAGE] * PAGE + pos % PAGE
    qstart = np.arange(batch + 1, dtype=np.int32) * new
    b = Batch(qstart, np.full(batch, ctx, np.int32), table, slots.astype(np.int32),
              (qstart[1:] - 1).astype(np.int32))
    tokens = rng.integers(0, vocab, batch * new).astype(np.int32)
    return tokens, pos, b, batch * pages


def predict(rec: dict, gpu: str):
    """The explorer's step time (ms) and bound for one measured point ("<preset>-<N>L" names a
    preset cut to N layers), with the current model."""
    from pallasite.sharding import MeshPlan
    from pallasite.tools import plan_model as pm
    name, _, layers = rec["model"].rpartition("-")
    config = load(name, int(layers.rstrip("L"))) if layers.endswith("L") else load(rec["model"], None)
    plan = MeshPlan.parse(rec["plan"])
    cluster = pm.Cluster(pm.GPUS[gpu], gpus_per_host=max(8, plan.size))
    step = (pm.prefill_step if rec["phase"] == "prefill" else pm.decode_step)(
        config, pm.shapes_of(config, plan), plan, cluster, pm.Workload(page_size=PAGE),
        rec["batch"], rec["length"])
    return step.time * 1e3, step.bound


def repredict(paths, out):
    """No GPU: the records of earlier runs with today's predictions (the measurements kept)."""
    records = []
    for path in paths:
        for rec in json.loads(open(path).read()):
            if "measured_ms" not in rec:
                continue
            ms, bound = predict(rec, "h200" if "H200" in rec["gpu"] else "h100")
            records.append(rec | dict(predicted_ms=ms, predicted_bound=bound,
                                      rel_error=(ms - rec["measured_ms"]) / rec["measured_ms"]))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_validation.json"), "w") as f:
        json.dump(records, f, indent=1)
    print_table(records)
    print(json.dumps(summary(records), indent=1))
    return 0


def time_steps(fn, params, kv, inputs, reps: int):
    """Median over 3 trials of the mean step time with `reps` steps dispatched back to back
    (the KV cache threads through, donated, so steps queue on the device like the engine's)."""
    import jax
    tok, pos, batch = inputs
    for _ in range(reps + 1):  # compile, then a trial's worth of untimed steps (clocks, caches)
        logits, kv = fn(params, tok, pos, kv, batch)
    jax.block_until_ready(logits)
    trials = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            logits, kv = fn(params, tok, pos, kv, batch)
        jax.block_until_ready(logits)
        trials.append((time.perf_counter() - t0) / reps)
    return float(np.median(trials)), kv


def run_group(group, deadline: float, tiny: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from pallasite.model import init_params
    from pallasite.sharding import Layout, MeshPlan, make_mesh
    from pallasite.tools import plan_model as pm

    name, layers, plan_text, points = group
    config, plan = load(name, layers), MeshPlan.parse(plan_text)
    mesh = make_mesh(plan)
    layout = Layout(config, mesh)
    devices = list(mesh.devices.flat)
    dtype = jnp.bfloat16
    params = jax.jit(lambda: init_params(config, 0, dtype), out_shardings=layout.params)()
    jax.block_until_ready(params)
    init_peak = peak_bytes(devices)
    rng = np.random.default_rng(0)
    num_pages = 1 + max(make_batch(ph, b, n, 2, rng)[3] for ph, b, n in points)
    kv = layout.init_kv_cache(num_pages, PAGE, dtype)
    fn = layout.forward()
    shapes = pm.shapes_of(config, plan)
    fixed = shapes.device_total * 2 + num_pages * PAGE * pm.kv_bytes_per_token(config, plan, 2)
    records, act_peak = [], 0.0
    for phase, batch, length in points:
        rec = dict(model=config.name, plan=plan_text, batch=batch, phase=phase,
                   length=length, tokens=batch * (length if phase == "prefill" else 1))
        if time.time() > deadline:
            records.append(rec | dict(error="skipped: out of time"))
            continue
        tok, pos, b, _ = make_batch(phase, batch, length, config.vocab_size, rng)
        inputs = layout.replicate((jnp.asarray(tok), jnp.asarray(pos),
                                   type(b)(*(jnp.asarray(x) for x in b))))
        reps = 2 if tiny else (5 if phase == "prefill" else 20)
        seconds, kv = time_steps(fn, params, kv, inputs, reps)
        act_peak = max(act_peak, pm.activation_bytes(config, plan, rec["tokens"], batch, 2))
        measured_peak = peak_bytes(devices)
        predicted_ms, bound = predict(rec, gpu_key())
        rec.update(predicted_ms=predicted_ms, measured_ms=seconds * 1e3,
                   rel_error=(predicted_ms - seconds * 1e3) / (seconds * 1e3),
                   predicted_bound=bound,
                   predicted_peak_gb=(fixed + act_peak) / 1e9,
                   measured_peak_gb=None if measured_peak is None else measured_peak / 1e9,
                   init_peak_gb=None if init_peak is None else init_peak / 1e9)
        records.append(rec)
    return records


# -- driver --------------------------------------------------------------------------------------
def run_in_subprocess(index: int, args, deadline: float) -> list[dict]:
    out = os.path.join(args.out, f".plan_validate_group{index}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--group", str(index), "--group-out", out,
           "--deadline", str(deadline)] + (["--tiny"] if args.tiny else []) + \
        [f"--devices={n}" for n in (args.devices or [])]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=max(10, deadline - time.time() + 60))
    if proc.returncode != 0 or not os.path.exists(out):
        return [dict(error=f"group {index} failed (rc {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")]
    with open(out) as f:
        records = json.load(f)
    os.remove(out)
    return records


def print_table(records):
    print(f"{'model':<20} {'plan':<16} {'phase':<8} {'batch':>5} {'pred ms':>9} {'meas ms':>9} "
          f"{'error':>7} {'pred GB':>8} {'meas GB':>8}")
    for r in records:
        if "measured_ms" not in r:
            print(f"{r.get('model', '?'):<20} {r.get('plan', ''):<16} {r.get('phase', ''):<8} "
                  f"{r.get('batch', ''):>5}  {r.get('error', '')[:300]}")
            continue
        meas = r["measured_peak_gb"]
        print(f"{r['model']:<20} {r['plan']:<16} {r['phase']:<8} {r['batch']:>5} "
              f"{r['predicted_ms']:>9.3f} {r['measured_ms']:>9.3f} {r['rel_error']:>+7.1%} "
              f"{r['predicted_peak_gb']:>8.2f} {'-' if meas is None else f'{meas:8.2f}':>8}")


def summary(records) -> dict:
    out = {}
    for phase in ("prefill", "decode"):
        errs = [abs(r["rel_error"]) for r in records if r.get("phase") == phase and "rel_error" in r]
        out[phase] = dict(points=len(errs),
                          median_abs_error=float(np.median(errs)) if errs else None)
    peaks = [abs(r["predicted_peak_gb"] / r["measured_peak_gb"] - 1) for r in records
             if r.get("measured_peak_gb")]
    out["peak_memory"] = dict(points=len(peaks),
                              median_abs_error=float(np.median(peaks)) if peaks else None)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    if args.repredict:
        return repredict(args.repredict, args.out)
    groups = groups_for(args)
    if args.group is not None:  # child: one group
        records = run_group(groups[args.group], args.deadline, args.tiny)
        with open(args.group_out, "w") as f:
            json.dump(records, f)
        return 0
    import jax
    os.makedirs(args.out, exist_ok=True)
    deadline = time.time() + args.time_limit
    records = []
    for i in range(len(groups)):
        records += run_in_subprocess(i, args, deadline)
    stamp = dict(gpu=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(),
                 jax_version=jax.__version__, command=" ".join([os.path.basename(sys.argv[0])] +
                                                               sys.argv[1:]))
    records = [r | stamp for r in records]
    print_table(records)
    print(json.dumps(summary(records), indent=1))
    path = os.path.join(args.out, "plan_validation.json")
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}")
    return 0 if all("measured_ms" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
