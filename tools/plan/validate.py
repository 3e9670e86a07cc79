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
import math
import subprocess
import time

import numpy as np

PAGE = 16
GB = 1e9
MICRO = "microbench"

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


# -- what the explorer predicts ------------------------------------------------------------------
def load(name: str, layers):
    from pallasite.model import config_from_dict
    from pallasite.tools.plan.model import load_model
    if name in TINY_MODELS:
        return config_from_dict(TINY_MODELS[name], name=name)
    return load_model(name, layers)


def config_of(model: str):
    """The config of a record's model: "<preset>-<N>L" names a preset cut to N layers."""
    name, _, layers = model.rpartition("-")
    if layers.endswith("L") and layers[:-1].isdigit():
        return load(name, int(layers[:-1]))
    return load(model, None)


def context_of(rec: dict) -> int:
    """Tokens in each sequence's cache after the step."""
    return rec["length"] + (rec["phase"] == "decode")


def predict(rec: dict, gpu: str):
    """The explorer's step time (ms) and bound for one measured point, with today's model."""
    from pallasite.sharding import MeshPlan
    from pallasite.tools.plan import model as pm
    config, plan = config_of(rec["model"]), MeshPlan.parse(rec["plan"])
    cluster = pm.Cluster(pm.GPUS[gpu], gpus_per_host=max(8, plan.size))
    step = (pm.prefill_step if rec["phase"] == "prefill" else pm.decode_step)(
        config, pm.shapes_of(config, plan), plan, cluster, pm.Workload(page_size=PAGE),
        rec["batch"], rec["length"])
    return step.time * 1e3, step.bound


def predict_peak(rec: dict) -> dict:
    """The explorer's per-device memory of one point: the weights, the KV pool the run
    allocated (`num_pages`) and the step's activations (`model.activation_bytes`)."""
    from pallasite.sharding import MeshPlan
    from pallasite.tools.plan import model as pm
    config, plan = config_of(rec["model"]), MeshPlan.parse(rec["plan"])
    weights = pm.shapes_of(config, plan).device_total * 2
    kv = rec["num_pages"] * PAGE * pm.kv_bytes_per_token(config, plan, 2)
    act = pm.activation_bytes(config, plan, rec["tokens"], rec["batch"], context_of(rec), 2, PAGE)
    return dict(predicted_peak_gb=(weights + kv + act) / GB, predicted_act_gb=act / GB,
                predicted_weights_gb=weights / GB, predicted_kv_gb=kv / GB)


def gpu_key(kind: str) -> str:
    return "h200" if "H200" in kind else "h100"


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


# -- one group, in its own process ---------------------------------------------------------------
def memory_stat(devices, key: str) -> float | None:
    """The largest `key` of memory_stats over the devices (None where not reported: CPU)."""
    stats = [d.memory_stats() or {} for d in devices]
    values = [s[key] for s in stats if key in s]
    return max(values) if values else None


def gb(x):
    return None if x is None else x / GB


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


def make_weights(config, layout, dtype, seed: int = 0):
    """Random weights (normal(0.02), norm scales at one) made one tensor at a time straight onto
    their shards, largest first: a tensor's creation never sits on top of many others, so the
    peak after this is the weights themselves (`init_peak_gb` shows it)."""
    import functools

    import jax
    import jax.numpy as jnp
    from pallasite.model import param_shapes

    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config, dtype))
    shardings = jax.tree.leaves(layout.params)
    made, makers = [None] * len(leaves), {}

    def leaf(key, shape, ones):
        if ones:
            return jnp.ones(shape, dtype)
        return jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype)

    key = jax.random.key(seed)
    for i in sorted(range(len(leaves)), key=lambda i: -math.prod(leaves[i][1].shape)):
        path, shape = leaves[i][0], leaves[i][1].shape
        sig = (shape, jax.tree_util.keystr(path).endswith("['scale']"), shardings[i])
        if sig not in makers:
            makers[sig] = jax.jit(functools.partial(leaf, shape=shape, ones=sig[1]),
                                  out_shardings=shardings[i])
        made[i] = makers[sig](jax.random.fold_in(key, i))
        made[i].block_until_ready()
    return jax.tree.unflatten(treedef, made)


def abstract(tree, sharding):
    """ShapeDtypeStructs of numpy arrays (or structs) on `sharding` (a tree of them or one)."""
    import jax
    if not isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, sharding)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def memory_analysis(compiled) -> dict:
    """XLA's own sizes of a compiled step on one device: temp buffers and the outputs that do
    not reuse a donated input (the logits)."""
    m = compiled.memory_analysis()
    if isinstance(m, (list, tuple)):
        m = m[0]
    if m is None:
        return dict(temp=None, output=None)
    return dict(temp=m.temp_size_in_bytes,
                output=m.output_size_in_bytes - m.alias_size_in_bytes)


def compile_points(layout, config, plan, points, num_pages, rng):
    """Every point's step compiled from shapes alone (nothing allocated yet), with its inputs
    (host arrays) and XLA's sizes; sorted by those sizes, smallest step first."""
    import jax
    import jax.numpy as jnp
    from pallasite.model import param_shapes
    from pallasite.sharding.rules import kv_cache_shape

    fn = layout.forward()
    params = abstract(param_shapes(config, jnp.bfloat16), layout.params)
    page = jax.ShapeDtypeStruct(kv_cache_shape(config, plan, num_pages, PAGE), jnp.bfloat16,
                                sharding=layout.kv_pages)
    kv = [(page, page) for _ in range(config.num_layers)]
    compiled = []
    for phase, batch, length in points:
        tok, pos, b, _ = make_batch(phase, batch, length, config.vocab_size, rng)
        t0 = time.perf_counter()
        exe = fn.lower(params, *abstract((tok, pos), layout.replicated), kv,
                       abstract(b, layout.replicated)).compile()
        sizes = memory_analysis(exe)
        compiled.append(dict(point=(phase, batch, length), exe=exe, inputs=(tok, pos, b),
                             compile_s=time.perf_counter() - t0, **sizes))
    return sorted(compiled, key=lambda c: (c["temp"] or 0) + (c["output"] or 0))


def time_steps(exe, params, kv, inputs, reps: int):
    """Median over 3 trials of the mean step time with `reps` steps dispatched back to back
    (the KV cache threads through, donated, so steps queue on the device like the engine's),
    after a trial's worth of untimed steps (clocks, caches, first-call work)."""
    import jax
    tok, pos, batch = inputs
    for _ in range(reps):
        logits, kv = exe(params, tok, pos, kv, batch)
    jax.block_until_ready(logits)
    trials = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            logits, kv = exe(params, tok, pos, kv, batch)
        jax.block_until_ready(logits)
        trials.append((time.perf_counter() - t0) / reps)
    del logits
    return float(np.median(trials)), kv


def run_group(group, deadline: float, tiny: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from pallasite.sharding import Layout, MeshPlan, make_mesh

    name, layers, plan_text, points = group
    config, plan = load(name, layers), MeshPlan.parse(plan_text)
    layout = Layout(config, make_mesh(plan))
    devices = list(layout.mesh.devices.flat)
    rng = np.random.default_rng(0)
    num_pages = 1 + max(make_batch(ph, b, n, 2, rng)[3] for ph, b, n in points)
    compiled = compile_points(layout, config, plan, points, num_pages, rng)
    compile_peak = memory_stat(devices, "peak_bytes_in_use")
    params = make_weights(config, layout, jnp.bfloat16)
    weights = memory_stat(devices, "bytes_in_use")
    init_peak = memory_stat(devices, "peak_bytes_in_use")
    kv = layout.init_kv_cache(num_pages, PAGE, jnp.bfloat16)
    jax.block_until_ready(kv)
    in_use = memory_stat(devices, "bytes_in_use")
    kv_bytes = None if in_use is None else in_use - weights
    gpu = devices[0].device_kind
    records = []
    for c in compiled:
        phase, batch, length = c["point"]
        rec = dict(model=config.name, plan=plan_text, batch=batch, phase=phase, length=length,
                   tokens=batch * (length if phase == "prefill" else 1), num_pages=num_pages)
        if time.time() > deadline:
            records.append(rec | dict(error="skipped: out of time"))
            continue
        inputs = layout.replicate(tuple(jnp.asarray(x) for x in c["inputs"][:2]) +
                                  (type(c["inputs"][2])(*map(jnp.asarray, c["inputs"][2])),))
        live = memory_stat(devices, "bytes_in_use")
        reps = 2 if tiny else (5 if phase == "prefill" else 20)
        seconds, kv = time_steps(c["exe"], params, kv, inputs, reps)
        peak = memory_stat(devices, "peak_bytes_in_use")
        predicted_ms, bound = predict(rec, gpu_key(gpu))
        xla_peak = None
        if live is not None and c["temp"] is not None:  # + this step's and the last's logits
            xla_peak = live + c["temp"] + 2 * c["output"]
        rec.update(predicted_ms=predicted_ms, measured_ms=seconds * 1e3,
                   rel_error=(predicted_ms - seconds * 1e3) / (seconds * 1e3),
                   predicted_bound=bound, **predict_peak(rec), measured_peak_gb=gb(peak),
                   weights_gb=gb(weights), kv_gb=gb(kv_bytes), live_gb=gb(live),
                   temp_gb=gb(c["temp"]), output_gb=gb(c["output"]), xla_peak_gb=gb(xla_peak),
                   compile_peak_gb=gb(compile_peak), init_peak_gb=gb(init_peak),
                   compile_s=round(c["compile_s"], 2), gpu=gpu)
        records.append(rec)
    return records


# -- microbenchmarks the constants need ----------------------------------------------------------
def allreduce_chain(devices: int, chain: int):
    """A jitted program of `chain` dependent all-reduces over `devices` devices, each fed by an
    elementwise op, as a tensor-parallel step runs them."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P
    from pallasite.sharding.parallel import shard_map

    mesh = Mesh(np.array(jax.devices()[:devices]), ("tensor",))

    def body(x):
        # Each device scales by its own weight (summing to one), so no operand is provably the
        # same on every device and XLA cannot fold an all-reduce into a multiplication.
        w = (jax.lax.axis_index("tensor") + 1).astype(x.dtype) / (devices * (devices + 1) / 2)
        for _ in range(chain):
            x = jax.lax.psum(x * w, "tensor")
        return x

    return mesh, jax.jit(shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                                   check_vma=False))


def allreduce_us(devices: int, hidden: int, rows_list, chain: int = 32, reps: int = 10) -> dict:
    """Microseconds per all-reduce of [rows, hidden] bf16 over `devices` devices in a chain of
    `chain` (`allreduce_chain`): rows -> us."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, fn = allreduce_chain(devices, chain)
    out = {}
    for rows in rows_list:
        x = jax.device_put(jnp.ones((rows, hidden), jnp.bfloat16), NamedSharding(mesh, P()))
        for _ in range(reps + 1):  # compile, then untimed calls
            x = fn(x)
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        for _ in range(reps):
            x = fn(x)
        jax.block_until_ready(x)
        out[str(rows)] = round((time.perf_counter() - t0) / (reps * chain) * 1e6, 2)
    return out


def run_micro(plan_text: str, tiny: bool) -> list[dict]:
    """The copy ceiling (HBM constant) and, with tensor > 1, the all-reduce times at the
    residual's sizes: decode batches 1/16/64 and a 2048-token prefill of a 4096-wide model."""
    from pallasite.sharding import MeshPlan
    rec = dict(kind=MICRO, plan=plan_text)
    if not tiny:
        try:  # before JAX takes the GPU's memory
            from benchmarks.common import torch_copy_bps  # a checkout: run from its root
            rec["copy_tbps"] = round(torch_copy_bps(2.0) / 1e12, 3)
        except Exception as err:  # no torch or no CUDA: report, keep going
            rec["copy_error"] = repr(err)[:300]
    import jax
    rec["gpu"] = jax.devices()[0].device_kind
    tensor = MeshPlan.parse(plan_text).tensor
    if tensor > 1:
        rows = (1, 16) if tiny else (1, 16, 64, 2048)
        rec["allreduce_hidden"] = 64 if tiny else 4096
        rec["allreduce_us"] = allreduce_us(tensor, rec["allreduce_hidden"], rows)
    return [rec]


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
