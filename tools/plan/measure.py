"""What `validate` measures in one process: a (model, plan) group's steps compiled first, then
random weights made on their shards, a paged KV cache, and each point timed with the device's
memory read after it; and the microbenchmarks the constants need (copy bandwidth, all-reduce)."""

from __future__ import annotations

import math
import time

import numpy as np

from .predict import GB, PAGE, gpu_key, load, predict, predict_peak

MICRO = "microbench"


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
