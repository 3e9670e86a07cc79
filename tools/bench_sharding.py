"""Sharding benchmark: one model step on one GPU against the same step split over two.

    python tools/bench_sharding.py --out DIR     # 2 GPUs: Llama-3-8B tp=1 vs 2, Mixtral ep=1 vs 2
    python tools/bench_sharding.py --tiny        # tiny shapes on 8 fake CPU devices (dry run)

For each model and mesh it times the cached paged step (`Layout.forward`, the serving step's
model part) as decode (one new token for each of `--batches` sequences, `--context` tokens each)
and as prefill (one sequence of `--prefill` tokens): medians of `--iters` timed calls after
warm-up. Weights are random bf16, made on the devices straight into their shardings; the split
run gets the one-device weights copied device to device, so both compute the same function, and
its logits on fresh random tokens are compared with the one-device ones (max abs difference).
Writes DIR/sharding.json (every record, with the GPU, JAX version, date and command) and prints
a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on 8 fake CPU devices")
    ap.add_argument("--layers", type=int, default=None, help="Llama layers (default 32)")
    ap.add_argument("--moe-layers", type=int, default=None, help="Mixtral layers (default 4)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,32)")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 1024)")
    ap.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 2048)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per step (default 50)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=200,
                    help="seconds after which the remaining meshes are skipped (recorded so)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tiny = args.tiny
    defaults = dict(layers=2 if tiny else 32, moe_layers=2 if tiny else 4,
                    batches="1,4" if tiny else "1,32", context=64 if tiny else 1024,
                    prefill=48 if tiny else 2048, iters=5 if tiny else 50)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    return args


def models(args):
    """(name, HF-style config dict, [(mesh name, (data, tensor, expert)), ...]) to measure."""
    if args.tiny:
        dense = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2)
        moe = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=96,
                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                   num_experts_per_tok=2)
    else:
        dense = dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     rope_theta=500000.0)
        moe = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                   intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                   num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6)
    common = dict(max_position_embeddings=8192, tie_word_embeddings=False)
    return [("llama3-8b-shaped", {**dense, **common, "num_hidden_layers": args.layers},
             [("tp=1", (1, 1, 1)), ("tp=2", (1, 2, 1))]),
            ("mixtral-8x7b-shaped", {**moe, **common, "num_hidden_layers": args.moe_layers},
             [("ep=1", (1, 1, 1)), ("ep=2", (1, 1, 2))])]


# -- steps ---------------------------------------------------------------------------------------

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


def step_inputs(args, config, rng):
    """Prefill: sequence 0's first `prefill` tokens. Decode at batch b: sequences 0..b-1 each
    computing its token at position `context - 1` (sequence 0 then reads what prefill wrote)."""
    width = -(-max(args.context, args.prefill) // args.page_size)
    shapes = {"prefill": ([args.prefill], [0])}
    for b in args.batches:
        shapes[f"decode b={b}"] = ([1] * b, [args.context - 1] * b)
    inputs = {name: paged_inputs(rng, config.vocab_size, lengths, starts, width, args.page_size)
              for name, (lengths, starts) in shapes.items()}
    return inputs, 1 + max(args.batches) * width


def compile_all(layout, params, kv, inputs):
    """Every step's executable, compiled in parallel threads (XLA compiles are independent)."""
    from concurrent.futures import ThreadPoolExecutor
    fn = layout.forward()
    lowered = {name: fn.lower(params, *layout.replicate(x[:2]), kv, layout.replicate(x[2]))
               for name, x in inputs.items()}
    with ThreadPoolExecutor(len(lowered)) as pool:
        return dict(zip(lowered, pool.map(lambda lo: lo.compile(), lowered.values())))


def timed(exe, params, kv, x, iters):
    """Median, 10th and 90th percentile ms of `iters` calls after 3 warm-up calls; the KV pages
    go round through every call (donated)."""
    import jax
    import numpy as np
    times = []
    for i in range(iters + 3):
        t = time.perf_counter()
        logits, kv = exe(params, x[0], x[1], kv, x[2])
        jax.block_until_ready(logits)
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - t))
    return dict(zip(("step_ms", "p10_ms", "p90_ms"), np.percentile(times, [50, 10, 90]))), kv


def measure_mesh(args, name, config, mesh_name, shape, params_one, inputs, num_pages):
    """Records for one mesh; params_one: the one-device params (None: make them here). Returns
    (records, params on this mesh, {step: logits of the fresh check inputs})."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallasite.model import init_params
    from pallasite.sharding import Layout, MeshPlan, make_mesh
    plan = MeshPlan(*shape)
    layout = Layout(config, make_mesh(plan))
    if params_one is None:  # made on the devices, straight into their shardings
        params = jax.jit(lambda: init_params(config, args.seed, jnp.bfloat16),
                         out_shardings=layout.params)()
    else:  # device to device, so both meshes compute with the same weights
        params = jax.device_put(params_one, layout.params)
    kv = layout.init_kv_cache(num_pages, args.page_size, jnp.bfloat16)
    inputs = {k: (*layout.replicate(x[:2]), layout.replicate(x[2])) for k, x in inputs.items()}
    t = time.perf_counter()
    exes = compile_all(layout, params, kv, inputs)
    compile_s = time.perf_counter() - t
    check = {}
    for step in ["prefill"] + [k for k in inputs if k != "prefill"]:  # decode reads prefill's K/V
        logits, kv = exes[step](params, *inputs[step][:2], kv, inputs[step][2])
        check[step] = np.asarray(logits.astype(jnp.float32))
    records = []
    for step, exe in exes.items():
        stats, kv = timed(exe, params, kv, inputs[step], args.iters)
        tokens = int(inputs[step][0].shape[0])
        records.append(dict(model=name, mesh=mesh_name, dp=plan.data, tp=plan.tensor,
                            ep=plan.expert, gpus=plan.size, layers=config.num_layers, step=step,
                            batch=1 if step == "prefill" else tokens, tokens=tokens,
                            context=args.prefill if step == "prefill" else args.context,
                            iters=args.iters, compile_s=round(compile_s, 2),
                            **{k: round(float(v), 4) for k, v in stats.items()},
                            step_ms_per_layer=round(float(stats["step_ms"]) / config.num_layers, 5)))
    return records, params, check


def measure_model(args, name, raw, meshes, rng, started, out):
    """Both meshes of one model; the second is compared with the first."""
    from pallasite.model import config_from_dict
    config = config_from_dict(raw)
    inputs, num_pages = step_inputs(args, config, rng)
    base, params_one = None, None
    for mesh_name, shape in meshes:
        if time.perf_counter() - started > args.time_limit:
            out.append(dict(model=name, mesh=mesh_name, skipped="time limit"))
            print(f"{name} {mesh_name}: skipped (time limit)", flush=True)
            continue
        try:
            records, params, check = measure_mesh(args, name, config, mesh_name, shape,
                                                  params_one, inputs, num_pages)
        except Exception as e:  # record it and go on: the other mesh may still be measured
            out.append(dict(model=name, mesh=mesh_name, error=f"{type(e).__name__}: {e}"[:2000]))
            print(f"{name} {mesh_name}: {type(e).__name__}: {e}"[:2000], flush=True)
            continue
        if base is None:
            base, params_one = (records, check), params
        else:
            compare(records, check, *base)
        out.extend(records)
        for r in records:
            print(f"{name} {mesh_name} {r['step']}: {r['step_ms']:.3f} ms "
                  f"(compile {r['compile_s']} s)", flush=True)
        params = None


def compare(records, check, base_records, base_check):
    """Speed-up over the one-device mesh and the largest logits difference from it."""
    import numpy as np
    base = {r["step"]: r for r in base_records}
    for r in records:
        b, got, want = base[r["step"]], check[r["step"]], base_check[r["step"]]
        r["speedup_vs_1"] = round(b["step_ms"] / r["step_ms"], 3)
        r["max_abs_logit_diff"] = float(np.max(np.abs(got - want)))
        r["max_abs_logit"] = float(np.max(np.abs(want)))


def table(records) -> str:
    rows = ["model                 mesh  step          ms/step  ms/layer  speedup  max|dlogit|"]
    for r in records:
        if "step_ms" not in r:
            rows.append(f"{r['model']:<21} {r['mesh']:<5} {r.get('skipped') or r.get('error')}"[:120])
            continue
        diff = r.get("max_abs_logit_diff")
        rows.append(f"{r['model']:<21} {r['mesh']:<5} {r['step']:<12} {r['step_ms']:>9.3f} "
                    f"{r['step_ms_per_layer']:>9.4f} {r.get('speedup_vs_1', 1.0):>7.2f}x "
                    f"{'' if diff is None else f'{diff:.3g}':>11}")
    return "\n".join(rows)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.tiny:  # must be set before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    started = time.perf_counter()
    devices = jax.devices()
    if len(devices) < 2:
        sys.exit(f"bench_sharding needs 2 devices; found {len(devices)}")
    rng = np.random.default_rng(args.seed)
    records: list[dict] = []
    for name, raw, meshes in models(args):
        measure_model(args, name, raw, meshes, rng, started, records)
    result = dict(gpu=devices[0].device_kind, gpus=len(devices), platform=devices[0].platform,
                  jax_version=jax.__version__, date=datetime.datetime.now().isoformat(
                      timespec="seconds"), command=" ".join([sys.executable] + sys.argv),
                  args={k: v for k, v in vars(args).items()},
                  wall_s=round(time.perf_counter() - started, 1), records=records)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sharding.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['gpu']} x{result['gpus']}, JAX {result['jax_version']}, "
          f"{result['wall_s']} s; records in {path}")
    print(table(records))
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
