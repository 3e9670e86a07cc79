"""Probe the GPU machine: library versions, copy ceiling, and batch-1 decode of a Llama-3-8B-shaped
model through `pallasite.model.forward` (random bf16 weights) against its weight-read roofline.

    python -m profiling.probe_gpu [--layers 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth


def versions():
    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "grpc", "google.protobuf",
                 "tokenizers", "safetensors", "transformers", "torch", "triton", "numpy"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # report, don't stop: this is a probe
            out[name] = f"missing ({type(e).__name__})"
    out["devices"] = [d.device_kind for d in jax.devices()]
    return out


def decode_probe(layers, ctx=512, page_size=16, steps=50):
    from pallasite.model import Batch, config_from_dict, forward, init_kv_cache, init_params
    config = config_from_dict(dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rope_theta=500000.0))
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    num_pages = ctx // page_size + 8
    kv = init_kv_cache(config, num_pages, page_size, jnp.bfloat16)
    step = jax.jit(lambda p, t, pos, kv, b: forward(p, config, t, pos, kv, b), donate_argnums=3)
    batch = Batch(jnp.array([0, 1], jnp.int32), jnp.array([ctx], jnp.int32),
                  jnp.arange(num_pages, dtype=jnp.int32)[None, : ctx // page_size],
                  jnp.array([ctx - 1], jnp.int32), jnp.array([0], jnp.int32))
    tok, pos = jnp.array([7], jnp.int32), jnp.array([ctx - 1], jnp.int32)
    t0 = time.perf_counter()
    logits, kv = step(params, tok, pos, kv, batch)
    logits.block_until_ready()
    compile_s = time.perf_counter() - t0
    for _ in range(5):
        logits, kv = step(params, tok, pos, kv, batch)
    logits.block_until_ready()
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        logits, kv = step(params, tok, pos, kv, batch)
        logits.block_until_ready()
        times.append(time.perf_counter() - s)
    # Pipelined: dispatch many steps back to back, sync once (what a decode loop sees).
    s = time.perf_counter()
    for _ in range(steps):
        logits, kv = step(params, tok, pos, kv, batch)
    logits.block_until_ready()
    pipelined = (time.perf_counter() - s) / steps
    kv_bytes = 2 * layers * config.num_kv_heads * ctx * config.head_dim * 2
    return dict(layers=layers, weight_gb=weight_bytes / 1e9, compile_s=compile_s,
                step_ms_synced=1e3 * float(np.median(times)), step_ms_pipelined=1e3 * pipelined,
                bytes_per_step=weight_bytes + kv_bytes)


def compare_flags(args):
    """Decode step time under each XLA_FLAGS setting, each in its own process."""
    import subprocess
    import sys
    rows = []
    for i, flags in enumerate(args.flags):
        out = os.path.join(args.out, f"flags{i}")
        os.makedirs(out, exist_ok=True)
        env = {**os.environ, "XLA_FLAGS": flags}
        subprocess.run([sys.executable, "-m", "profiling.probe_gpu", "--layers", str(args.layers), "--out", out],
                       env=env, check=False, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "probe.json")) as f:
            d = json.load(f)["decode"]
        rows.append((flags or "(default)", d["step_ms_synced"], d["step_ms_pipelined"], d["roofline_ms"]))
    print(f"{'XLA_FLAGS':70s} {'synced ms':>10s} {'pipelined':>10s} {'roofline':>9s}")
    for r in rows:
        print(f"{r[0][:70]:70s} {r[1]:10.2f} {r[2]:10.2f} {r[3]:9.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--flags", nargs="*", default=None,
                    help="time decode once per XLA_FLAGS value, each in a fresh process")
    args = ap.parse_args()
    if args.flags is not None:
        return compare_flags(args)
    info = {"versions": versions()}
    print(json.dumps(info["versions"]), flush=True)
    bw, how = copy_bandwidth()
    info["copy_tbps"], info["copy_how"] = bw / 1e12, how
    print(f"copy ceiling {bw / 1e12:.2f} TB/s ({how})", flush=True)
    d = decode_probe(args.layers)
    roof_ms = 1e3 * d["bytes_per_step"] / bw
    d.update(roofline_ms=roof_ms, frac_synced=roof_ms / d["step_ms_synced"],
             frac_pipelined=roof_ms / d["step_ms_pipelined"])
    info["decode"] = d
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(d, indent=1))


if __name__ == "__main__":
    main()
