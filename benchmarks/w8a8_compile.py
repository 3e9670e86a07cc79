"""What the W8A8 product's output dtype and XLA's GEMM autotuning cost at compile time and buy
at run time: one Llama-3-8B-shaped layer's four fused products (qkv, o, gate_up, down; no
attention) jitted at each of the engine's token buckets past 16 rows, each variant in a fresh
process (XLA_FLAGS are read at start). Per bucket: the compile time (XLA autotunes each new GEMM
shape once a process, so the sum over buckets is what a serving warm-up pays for these
products) and the GPU time of one call, L2 flushed, against the bf16 layer timed in the same
trace. `--products` adds the W8A16 alternatives (up to 256 rows: the Pallas kernel,
`kernels/w8a16_matmul.py`, and XLA's dot over the weight converted in the graph) and INT8 W8A8.

    python -m benchmarks.w8a8_compile --out $OUT        # H100: about 6 minutes
    python -m benchmarks.w8a8_compile --out $OUT --variants bf16_cublas --ms 1,2,4,8,16,32,64 \
        --products bf16,w8a8,w8a16_pallas,int8        # where W8A16 gives way to W8A8
    python -m benchmarks.w8a8_compile --tiny --out /tmp/c   # CPU: small shapes, one variant

Each product is checked against `quant_reference.w8a8_reference` (with the product rounded to
bf16 where the GEMM writes bf16) on fresh random inputs before timing. Writes
DIR/w8a8_compile.json and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MS = (8192, 2048, 512, 128, 64, 32, 4096, 1024, 256, 1536, 768, 384)  # most telling first
W8A16_MAX = 256
# name -> (the GEMM's output dtype, XLA_FLAGS added)
VARIANTS = {"f32": ("float32", ""), "bf16": ("bfloat16", ""),
            "bf16_cublas": ("bfloat16", "--xla_gpu_enable_triton_gemm=false"),
            "f32_cublas": ("float32", "--xla_gpu_enable_triton_gemm=false")}
SHAPES = dict(d=4096, qkv=6144, f=14336)
TINY = dict(d=256, qkv=384, f=512)


def layer(x, w, product):
    """x + the four products of one layer (no attention, no norms): what the step's GEMMs do."""
    import jax
    import jax.numpy as jnp
    d = x.shape[1]
    h = product(x, *w["qkv"])
    a = x + product(h[:, :d], *w["o"])
    g = product(a, *w["gate_up"])
    f = g.shape[1] // 2
    return a + product(jax.nn.silu(g[:, :f]) * g[:, f:], *w["down"]).astype(jnp.bfloat16)


def weights(key, s):
    """name -> (float8 [N, K], scale [1, N], bf16 [K, N], int8 [N, K], its scale) per
    product."""
    import jax
    import jax.numpy as jnp
    from pallasite.kernels import quant_reference as qr
    out = {}
    for i, (name, (k, n)) in enumerate({"qkv": (s["d"], s["qkv"]), "o": (s["d"], s["d"]),
                                        "gate_up": (s["d"], 2 * s["f"]),
                                        "down": (s["f"], s["d"])}.items()):
        w = jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) / k ** 0.5
        scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / qr.FP8_MAX
        q = jnp.asarray((w / scale).astype(jnp.float8_e4m3fn).T, copy=True)
        s8 = jnp.max(jnp.abs(w), axis=0, keepdims=True) / qr.INT8_MAX
        i8 = jnp.asarray(jnp.round(w / s8).astype(jnp.int8).T, copy=True)
        out[name] = (q, scale, w.astype(jnp.bfloat16), i8, s8)
    return out


def products(out_dtype, interpret):
    """name -> (product fn (x, q, scale, w_bf16), the largest M it runs at)."""
    import jax.numpy as jnp
    from pallasite.kernels import quant_matmul, quant_reference as qr
    out = jnp.dtype(out_dtype)

    def w8a8(x, q, s, *_):
        xq, xs = qr.quantize_rows(x)
        return qr.w8a8_dot(xq, xs, q, s, layout="nk", out=out).astype(x.dtype)

    return {"bf16": (lambda x, q, s, w, *_: x @ w, max(MS)),
            "w8a8": (w8a8, max(MS)),
            "w8a16_pallas": (lambda x, q, s, *_: quant_matmul(
                x, q, s, mode="w8a16", layout="nk", interpret=interpret), W8A16_MAX),
            "w8a16_xla": (lambda x, q, s, *_: x @ (q.T.astype(jnp.bfloat16) * s.astype(
                jnp.bfloat16)), W8A16_MAX),
            "int8": (lambda x, q, s, w, i8, s8: qr.w8a8_int8_matmul(x, i8, s8, layout="nk"),
                     max(MS))}


def child(name, args):
    import jax
    import jax.numpy as jnp
    from benchmarks import common
    from pallasite.kernels import quant_reference as qr
    out_dtype, _ = VARIANTS[name]
    s = TINY if args.tiny else SHAPES
    ms = [int(m) for m in args.ms.split(",")] if args.ms else (64, 32) if args.tiny else MS
    w = weights(jax.random.key(0), s)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(8)))  # backend start-up
    prods = products(out_dtype, args.tiny)
    prods = {k: prods[k] for k in args.products.split(",")}
    t0, records, calls = time.time(), [], []
    for m in ms:
        if time.time() - t0 > args.child_limit:
            print(f"  {name}: time limit, M={m} and later not compiled", flush=True)
            break
        key = jax.random.key(m)
        x = jax.random.normal(key, (m, s["d"]), jnp.bfloat16)
        for pname, (fn, max_m) in prods.items():
            if m > max_m:
                continue
            rec = dict(variant=name, product=pname, m=m)
            try:
                t = time.time()
                exe = jax.jit(lambda x, w, fn=fn: layer(x, w, fn)).lower(x, w).compile()
                rec["compile_s"] = round(time.time() - t, 2)
                # one product on fresh rows of very different sizes, memory poisoned
                xc = (jax.random.normal(jax.random.fold_in(key, 1), (m, s["d"]), jnp.float32)
                      * jax.random.uniform(jax.random.fold_in(key, 2), (m, 1), jnp.float32,
                                           0.1, 10)).astype(jnp.bfloat16)
                q, sc, wb, i8, s8 = w["o"]
                common.poison() if jax.default_backend() == "gpu" else None
                got = jax.jit(fn)(xc, *w["o"])
                if pname == "bf16":
                    ref = xc.astype(jnp.float32) @ wb.astype(jnp.float32)
                elif pname == "int8":
                    ref = qr.w8a8_int8_reference(xc, i8, s8, layout="nk")
                else:
                    ref = qr.w8a8_reference(xc, q, sc, layout="nk", product=jnp.dtype(
                        out_dtype) if pname == "w8a8" and jax.default_backend() == "gpu"
                        else jnp.float32)
                    if pname.startswith("w8a16"):  # bf16 activations: the dequantized weight
                        ref = xc.astype(jnp.float32) @ (q.T.astype(jnp.float32) * sc)
                rec["rel_err"] = float(common.rel_err(got, ref))
                calls.append((rec, exe, (x, w)))
            except Exception as e:  # a variant that fails is a finding, not a stop
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            records.append(rec)
            print(f"  {name} M={m} {pname}: {rec}", flush=True)
    times = common.device_times([(exe, a) for _, exe, a in calls], args.reps)
    for (rec, _, _), (ms_, _) in zip(calls, times):
        rec["us"] = round(1e3 * ms_, 1)
    print("RESULT " + json.dumps(records), flush=True)


def table(records):
    bf16 = {(r["variant"], r["m"]): r.get("us") for r in records if r["product"] == "bf16"}
    lines = ["| variant | product | M | compile s | us | vs bf16 (same trace) | rel err |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["variant"], r["product"], r["m"])):
        base, us = bf16.get((r["variant"], r["m"])), r.get("us")
        ratio = f"{base / us:.2f}" if base and us else ""
        lines.append(f"| {r['variant']} | {r['product']} | {r['m']} | {r.get('compile_s', '')} "
                     f"| {us or r.get('error', '')[:60]} | {ratio} | {r.get('rel_err', 0):.1e} |")
    lines += ["", "| variant | product | buckets compiled | compile s, sum |", "|---|---|---|---|"]
    sums = {}
    for r in records:
        if "compile_s" in r:
            n, t = sums.get((r["variant"], r["product"]), (0, 0.0))
            sums[(r["variant"], r["product"])] = (n + 1, t + r["compile_s"])
    lines += [f"| {v} | {p} | {n} | {t:.1f} |" for (v, p), (n, t) in sorted(sums.items())]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="small shapes, interpret mode (CPU)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ms", default=None, help="comma-separated rows (default: the buckets)")
    p.add_argument("--products", default="bf16,w8a8",
                   help="of bf16, w8a8, w8a16_pallas, w8a16_xla (<= 256 rows), int8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--child-limit", type=float, default=75.0,
                   help="seconds of compiling a variant; later buckets are skipped")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args)
    from benchmarks import common
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head, records = common.run_info(), []
    for name in (["f32"] if args.tiny else args.variants.split(",")):
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {VARIANTS[name][1]}".strip()
        cmd = [sys.executable, "-m", "benchmarks.w8a8_compile", "--child", name,
               "--reps", str(args.reps), "--child-limit", str(args.child_limit),
               "--products", args.products] + (["--ms", args.ms] if args.ms else [])
        run = subprocess.run(cmd + (["--tiny"] if args.tiny else []), env=env,
                             capture_output=True, text=True)
        print(run.stdout[-3000:], run.stderr[-2000:] if run.returncode else "", flush=True)
        for line in run.stdout.splitlines():
            if line.startswith("RESULT "):
                records += [head | dict(xla_flags=env["XLA_FLAGS"]) | r
                            for r in json.loads(line[7:])]
        (out / "w8a8_compile.json").write_text(json.dumps(dict(head=head, command=common.command(),
                                                                records=records), indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
