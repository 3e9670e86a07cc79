"""Mixture-of-experts SwiGLU experts on the GPU: the Pallas grouped matmul path
(`kernels.grouped_mlp`) against `lax.ragged_dot` (XLA), in the same run, with the bytes of the
experts that are used over the copy bandwidth as the memory floor and the routed FLOPs over the
measured matmul rate as the compute floor.

    python -m benchmarks.bench_moe --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallasite import kernels
from pallasite.kernels.reference import grouped_mlp_reference

from .common import copy_bandwidth, host_ms, run_info

SHAPES = {  # experts, hidden, expert MLP units, top-k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}


def case(name, tokens, rng, copy_bps, matmul_tflops):
    e, d, f, k = SHAPES[name]
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    wg, wu = (jax.random.normal(kk, (e, d, f), jnp.bfloat16) * 0.02 for kk in keys[:2])
    wd = jax.random.normal(keys[2], (e, f, d), jnp.bfloat16) * 0.02
    x = jax.random.normal(keys[3], (tokens * k, d), jnp.bfloat16)
    experts = np.sort(np.concatenate([rng.choice(e, k, replace=False) for _ in range(tokens)]))
    sizes = jnp.asarray(np.bincount(experts, minlength=e), jnp.int32)
    ours = jax.jit(lambda *a: kernels.grouped_mlp(*a, impl="pallas"))
    xla = jax.jit(grouped_mlp_reference)
    got, want = ours(x, sizes, wg, wu, wd), xla(x, sizes, wg, wu, wd)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32))
                / jnp.linalg.norm(want.astype(jnp.float32)))
    used = int((np.asarray(sizes) > 0).sum())
    mem_ms = used * 3 * d * f * 2 / copy_bps * 1e3
    flop_ms = tokens * k * 3 * 2 * d * f / (matmul_tflops * 1e12) * 1e3
    t_ours, t_xla = host_ms(ours, x, sizes, wg, wu, wd), host_ms(xla, x, sizes, wg, wu, wd)
    return dict(model=name, tokens=tokens, rows=tokens * k, experts_used=used, ours_ms=t_ours,
                xla_ragged_dot_ms=t_xla, speedup=t_xla / t_ours, floor_ms=max(mem_ms, flop_ms),
                of_floor=max(mem_ms, flop_ms) / t_ours, rel_err=err)


def random_experts(key, e, k, n, bits, group=128):
    """Packed experts with random codes and scales (`kernels.grouped_int.IntExperts`)."""
    from pallasite.kernels.grouped_int import IntExperts
    kw, ks = jax.random.split(key)
    words = jax.random.bits(kw, (e, k * bits // 32, n), jnp.uint32).view(jnp.int32)
    scale = jax.random.uniform(ks, (e, k // group, n), jnp.float32, 1e-3, 4e-3)
    return IntExperts(words, scale, None, None, bits, group)


def int_case(name, tokens, rng, copy_bps, bits):
    """Packed INT experts through the grouped kernel against their dequantized reference and
    against the bf16 experts' kernel, same shapes and rows (output poisoned first)."""
    from pallasite.kernels.grouped_int import grouped_int_mlp_reference
    from .common import poison
    e, d, f, k = SHAPES[name]
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 5)
    ws = [random_experts(keys[0], e, d, f, bits), random_experts(keys[1], e, d, f, bits),
          random_experts(keys[2], e, f, d, bits)]
    x = jax.random.normal(keys[3], (tokens * k, d), jnp.bfloat16)
    experts = np.sort(np.concatenate([rng.choice(e, k, replace=False) for _ in range(tokens)]))
    sizes = jnp.asarray(np.bincount(experts, minlength=e), jnp.int32)
    arrays = [(w.words, w.scale) for w in ws]  # bits and group size stay static
    packed = lambda arrays: [w._replace(words=a, scale=b) for w, (a, b) in zip(ws, arrays)]
    ours = jax.jit(lambda x, s, a: kernels.grouped_mlp(x, s, *packed(a), impl="pallas"))
    poison()
    got = ours(x, sizes, arrays)
    want = jax.jit(lambda x, s, a: grouped_int_mlp_reference(x, s, *packed(a)))(x, sizes, arrays)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32))
                / jnp.linalg.norm(want.astype(jnp.float32)))
    t_int = host_ms(ours, x, sizes, arrays)
    # the kernel as it was: each slab's MMA scaled on its own, in 16- or 64-row blocks
    from pallasite.kernels.grouped_matmul import block_m_for
    slab = jax.jit(lambda x, s, a: kernels.grouped_mlp(x, s, *packed(a), impl="pallas",
                                                       per_group=False,
                                                       block_m=block_m_for(x.shape[0], e)))
    poison()
    got_slab = slab(x, sizes, arrays)
    err_slab = float(jnp.linalg.norm((got_slab - want).astype(jnp.float32))
                     / jnp.linalg.norm(want.astype(jnp.float32)))
    t_slab = host_ms(slab, x, sizes, arrays)
    t_fma = err_fma = None
    if x.shape[0] <= e:  # a row an expert or fewer: one-row blocks by FMA, same run
        fma = jax.jit(lambda x, s, a: kernels.grouped_mlp(x, s, *packed(a), impl="pallas",
                                                          block_m=1))
        poison()
        got_fma = fma(x, sizes, arrays)
        err_fma = float(jnp.linalg.norm((got_fma - want).astype(jnp.float32))
                        / jnp.linalg.norm(want.astype(jnp.float32)))
        t_fma = host_ms(fma, x, sizes, arrays)
    del ws, arrays, packed
    wb = [jax.random.normal(keys[4], shape, jnp.bfloat16) * 0.02
          for shape in ((e, d, f), (e, d, f), (e, f, d))]
    plain = jax.jit(lambda x, s, *w: kernels.grouped_mlp(x, s, *w, impl="pallas"))
    t_bf16 = host_ms(plain, x, sizes, *wb)
    used = int((np.asarray(sizes) > 0).sum())
    mem_ms = used * 3 * d * f * (bits / 8 + 4 / 128) / copy_bps * 1e3
    return dict(model=name, mode=f"w{bits}a16_experts", tokens=tokens, rows=tokens * k,
                experts_used=used, int_ms=t_int, bf16_ms=t_bf16, speedup_vs_bf16=t_bf16 / t_int,
                int_per_slab_ms=t_slab, rel_err_per_slab=err_slab, int_fma_rows_ms=t_fma,
                rel_err_fma_rows=err_fma, memory_floor_ms=mem_ms,
                of_floor=mem_ms / t_int, rel_err=err)


def matmul_rate():
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    ms = host_ms(jax.jit(lambda a: a @ a), a)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1,32,256,2048")
    ap.add_argument("--bits", type=int, default=0,
                    help="4 or 8: packed INT experts against bf16 ones instead (moe_int.json)")
    args = ap.parse_args()
    if args.bits:
        return main_int(args)
    copy_bps, how = copy_bandwidth(gb=4)
    copy_tbps = copy_bps / 1e12
    tflops = matmul_rate()
    rng = np.random.default_rng(0)
    head = dict(**run_info(), copy_tbps=copy_tbps, copy_how=how, matmul_tflops=tflops)
    records = []
    for name in SHAPES:
        for tokens in [int(t) for t in args.tokens.split(",")]:
            try:
                records.append({**head, **case(name, tokens, rng, copy_bps, tflops)})
            except Exception as e:  # record and go on
                records.append({**head, "model": name, "tokens": tokens, "error": repr(e)[:400]})
            Path(args.out, "moe.json").write_text(json.dumps(records, indent=1))
    print(f"{head['gpu']}, JAX {head['jax_version']}, copy {copy_tbps:.2f} TB/s, "
          f"matmul {tflops:.0f} TFLOP/s")
    print("| model | tokens | experts used | ours ms | XLA ragged_dot ms | speedup | floor ms | "
          "of floor | rel err |\n|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            print(f"| {r['model']} | {r['tokens']} | error: {r['error'][:80]} |")
            continue
        print(f"| {r['model']} | {r['tokens']} | {r['experts_used']} | {r['ours_ms']:.3f} | "
              f"{r['xla_ragged_dot_ms']:.3f} | {r['speedup']:.1f}x | {r['floor_ms']:.3f} | "
              f"{r['of_floor']:.0%} | {r['rel_err']:.1e} |")


def main_int(args):
    copy_bps, how = copy_bandwidth(gb=4)
    rng = np.random.default_rng(0)
    head = dict(**run_info(), copy_tbps=copy_bps / 1e12, copy_how=how)
    records = []
    for name in SHAPES:
        for tokens in [int(t) for t in args.tokens.split(",")]:
            try:
                records.append({**head, **int_case(name, tokens, rng, copy_bps, args.bits)})
            except Exception as e:  # record and go on
                records.append({**head, "model": name, "tokens": tokens, "error": repr(e)[:400]})
            Path(args.out, "moe_int.json").write_text(json.dumps(records, indent=1))
            print(json.dumps(records[-1]), flush=True)
    print(f"{head['gpu']}, JAX {head['jax_version']}, copy {head['copy_tbps']:.2f} TB/s")
    print("| model | tokens | experts used | INT ms | INT ms, per-slab MMAs | bf16 ms | speedup | "
          "memory floor ms | of floor | rel err |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            print(f"| {r['model']} | {r['tokens']} | error: {r['error'][:80]} |")
            continue
        print(f"| {r['model']} | {r['tokens']} | {r['experts_used']} | {r['int_ms']:.3f} | "
              f"{r['int_per_slab_ms']:.3f} | {r['bf16_ms']:.3f} | {r['speedup_vs_bf16']:.2f}x | "
              f"{r['memory_floor_ms']:.3f} | "
              f"{r['of_floor']:.0%} | {r['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
