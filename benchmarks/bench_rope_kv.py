"""A fused q/k/v projection's epilogue: RoPE on queries and key and the page write in one launch
(`kernels/rope_kv.py`) against XLA's passes that it replaces (the queries' RoPE, the key's RoPE
stacked with the value, then the KV write kernel: `PALLASITE_ROPE_KV=0`), Llama-3-8B heads
(32 queries, 8 kv heads, head dim 128) or `--heads` / `--head-dim`, pages of 16, at 1-8192
tokens of a step; with `--norm` the q/k RMSNorms before RoPE (Qwen3), with `--rotary R` RoPE
over the leading R columns of a head.

    python -m benchmarks.bench_rope_kv --out DIR              # GPU
    python -m benchmarks.bench_rope_kv --out DIR --heads 4,7 --bias   # Qwen2.5-7B's, with bias
    python -m benchmarks.bench_rope_kv --out DIR --norm               # Qwen3-8B's q/k norms
    python -m benchmarks.bench_rope_kv --out DIR --tiny       # CPU, interpret mode (does it run)

Each variant first runs on fresh random inputs with freed device memory poisoned and must give
the jitted reference's queries and pages (relative error <= 1e-2: XLA and Triton may contract
RoPE's products differently, a rounding step apart). Times are the summed GPU time of the kernels a
call launches (pages donated, each call's pages the next call's), the L2 flushed before each,
median of --reps. Writes DIR/bench_rope_kv.json and prints ms per call and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from pallasite.kernels import pl_next_power_of_2, reference, rope_kv, write_kv

PAGE = 16


def inputs(rng, T, fp8, KV, G, args):
    P, D, R = T // PAGE + 64, args.head_dim, args.rotary or args.head_dim
    W = pl_next_power_of_2(D)  # the pages' width (`ModelConfig.page_head_dim`)
    y = jnp.asarray(rng.standard_normal((T, KV, G + 2, D)), jnp.bfloat16)
    angles = rng.integers(0, 2048, T)[:, None] * 500000.0 ** (-np.arange(0, R, 2) / R)
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    slots = rng.permutation(P * PAGE)[:T].astype(np.int32)
    if T > 1:
        slots[T // 2] = -1  # a padding token
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    kp = jnp.asarray(rng.standard_normal((KV, P, PAGE, W)), jnp.float32).astype(dtype)
    vp = jnp.asarray(rng.standard_normal((KV, P, W, PAGE) if fp8 else (KV, P, PAGE, W)),
                     jnp.float32).astype(dtype)
    extra = dict(k_scale=jnp.full((KV,), 0.05), v_scale=jnp.full((KV,), 0.02)) if fp8 else {}
    if args.norm:  # weights near one, as trained norms are
        extra["norm"] = tuple(jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16)
                              for _ in range(2))
    if args.bias:
        extra["bias"] = tuple(jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)
                              for n in (KV * G, KV, KV))  # bq, bk, bv
    return y, kp, vp, jnp.asarray(slots), cos, sin, extra


def variants(tiny, extra):
    """name -> fn((q, k_pages, v_pages), y, slots, cos, sin) -> (q, k_pages, v_pages): the
    first argument's q is only a buffer to donate, so each call's outputs feed the next."""
    def xla(state, y, slots, cos, sin):
        q, k, v = reference.rope_projection(y, cos, sin, extra.get("bias"), extra.get("norm"))
        scales = {name: x for name, x in extra.items() if name.endswith("_scale")}
        k, v = (reference.pad_last(x, state[1].shape[-1]) for x in (k, v))
        return (q, *write_kv(*state[1:], k, v, slots, impl="pallas", interpret=tiny, **scales))

    def fused(tokens, warps):
        return lambda state, y, slots, cos, sin: rope_kv.rope_write_kv(
            y, *state[1:], slots, cos, sin, tokens=tokens, num_warps=warps, interpret=tiny,
            **extra)
    # tokens a program, warps (4 tokens spill at 4 warps, offline sm_90a compile)
    tiles = ((1, 4), (2, 4), (4, 8), (8, 8))
    return {"xla": xla, **{f"fused_t{n}w{w}": fused(n, w) for n, w in tiles}}


def run(T, fp8, args):
    rng = np.random.default_rng(T)
    KV, G = args.heads
    y, kp, vp, slots, cos, sin, extra = inputs(rng, T, fp8, KV, G, args)
    q0 = jnp.zeros((T, KV * G, args.head_dim), jnp.bfloat16)
    ref = jax.jit(lambda *a: reference.rope_write_kv_reference(*a, **extra))(
        y, kp, vp, slots, cos, sin)
    out = []
    for name, fn in variants(args.tiny, extra).items():
        if not args.tiny:
            common.poison()
        got = jax.jit(fn)((q0, kp, vp), y, slots, cos, sin)
        err = max(common.rel_err(a, b) for a, b in zip(got, ref))  # NaN: an element unwritten
        del got
        rec = dict(common.run_info(device=not args.tiny), kernel="rope_write_kv", variant=name,
                   tokens=T, pages="float8_e4m3fn" if fp8 else "bfloat16", kv_heads=KV,
                   group=G, head_dim=args.head_dim, rotary=args.rotary or args.head_dim,
                   bias=args.bias, norm=args.norm, rel_err=err)
        if err <= 1e-2:  # RoPE's float32 products may round apart by a bf16 / e4m3 step
            state = tuple(jnp.copy(a) for a in (q0, kp, vp))
            if args.tiny:  # no GPU trace: host time of the interpreted call
                rec["ms"], rec["kernels"] = common.host_ms(fn, state, y, slots, cos, sin,
                                                           reps=2), []
            else:
                rec["ms"] = common.device_ms(fn, state, y, slots, cos, sin, reps=args.reps,
                                             chain=True)
                rec["kernels"] = list(common.DEVICE_KERNELS)
        out.append(rec)
    base = next((r["ms"] for r in out if r["variant"] == "xla" and "ms" in r), None)
    for r in out:
        if base and "ms" in r:
            r["speedup_vs_xla"] = base / r["ms"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU, interpret mode, small steps")
    ap.add_argument("--tokens", default="1,64,256,2048,8192")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--heads", type=lambda s: tuple(int(x) for x in s.split(",")), default=(8, 4),
                    help="KV,G: kv heads and queries a kv head (Llama-3-8B: 8,4)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rotary", type=int, default=0, help="columns RoPE turns (0: the head)")
    ap.add_argument("--bias", action="store_true", help="a q/k/v bias (Qwen2, GPT-OSS)")
    ap.add_argument("--norm", action="store_true", help="q/k RMSNorms (Qwen3, Gemma 3)")
    args = ap.parse_args(argv)
    print(json.dumps(common.run_info(device=not args.tiny)), flush=True)
    records = []
    for fp8 in (False, True):
        for T in ([1, 5] if args.tiny else [int(x) for x in args.tokens.split(",")]):
            recs = run(T, fp8, args)
            records += recs
            print(f"{'float8' if fp8 else 'bf16'} pages, {T} tokens: " + "  ".join(
                f"{r['variant']} " + (f"{r['ms'] * 1e3:.1f} us ({len(r['kernels'])} kernels)"
                                      if "ms" in r else "NOT THE REFERENCE'S")
                for r in recs), flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_rope_kv.json"), "w") as f:
                json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
