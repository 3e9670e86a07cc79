"""The sharding benchmark's measurements: the models (dense and MoE shapes, as many layers as a
device holds), their paged decode step on each mesh timed synced and pipelined and checked
against the one-device mesh, and the collectives alone at the sizes a decode step sends."""

from __future__ import annotations

import gc
import math
import time

from .sharding_report import device_profile, hlo_stats

DENSE, MOE = "llama3-70b-shaped", "mixtral-8x7b-shaped"
FULL_LAYERS = {DENSE: 80, MOE: 32}


def say(text):
    print("> " + text, flush=True)


def late(args) -> bool:
    return args.deadline is not None and time.time() > args.deadline


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
