"""GPU benchmark of the attention options: float8 KV pages and sliding-window decode.

  python -m benchmarks.bench_attention_features --out DIR        (~2-3 minutes on an H100)

1. Paged decode, batch 64, context 4k, 32 query / 8 kv heads of 128, pages of 16: float8
   pages (per-KV-head scales) against bf16 pages, timed in the same run; bandwidth counted in
   the bytes each reads (K and V once), as a fraction of a device copy's (read + written)
   measured here too. A few tile shapes for the float8 pages are timed as well (their pages are
   half as many bytes per key, so other tiles may suit them).
2. Sliding-window decode, window 4k, context 32k, batch 8, against full decode at context 4k.

Every timed call is first checked against the jnp reference on fresh random inputs, with
freed device memory filled with NaN first (an element no program writes shows). Times are
medians over back-to-back calls after warm-up. Writes DIR/attention_features.json and prints
a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallasite import kernels as K
from pallasite.kernels import reference

H, KV, D, PAGE = 32, 8, 128, 16
SMOKE = {"on": False}  # --smoke: tiny shapes in Pallas's interpreter (checks the script on CPU)


def time_ms(fn, *args, reps=20, inner=10):
    if SMOKE["on"]:
        reps, inner = 1, 1
    """Median ms per call over `inner` back-to-back jitted calls (launches overlap the GPU)."""
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = [f(*args) for _ in range(inner)]
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / inner)
    return 1e3 * float(np.median(ts))


def copy_tbps():
    """Bytes read + written per second by a 2 GiB device copy."""
    n = 2**30
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    ms = time_ms(lambda x: x * 1, x, reps=10, inner=5)
    del x
    return 4 * n / (ms / 1e3) / 1e12


def poison():
    if SMOKE["on"]:
        return
    x = jnp.full((512 * 2**20,), jnp.nan, jnp.float32)  # 2 GiB of NaN, freed again
    x.block_until_ready()
    del x


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def decode_inputs(key, B, ctx, dtype=jnp.bfloat16):
    """q [B, H, D], pages [KV, P, PAGE, D] (shuffled over the table), context_lens, table."""
    pps = -(-ctx // PAGE)
    kq, kk, kv, kt = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, H, D), dtype)
    kp = jax.random.normal(kk, (KV, B * pps, PAGE, D), dtype)
    vp = jax.random.normal(kv, (KV, B * pps, PAGE, D), dtype)
    table = jax.random.permutation(kt, B * pps).reshape(B, pps).astype(jnp.int32)
    return q, kp, vp, jnp.full((B,), ctx, jnp.int32), table


def checked(name, fn, args, ref_fn, tol, log):
    poison()
    err = rel_err(jax.jit(fn)(*args), jax.jit(ref_fn)(*args))
    ok = err <= tol
    log(f"  {name}: rel err {err:.2e} ({'ok' if ok else 'FAILED'})")
    return err, ok


def fp8_decode(log, ceiling, B=64, ctx=4096):
    q, kp, vp, lens, table = decode_inputs(jax.random.PRNGKey(1), B, ctx)
    scale = jnp.linspace(0.004, 0.012, KV)  # ~ amax / 448 of unit normals, per kv head
    kq = reference.quantize_kv(kp.reshape(KV, -1, D).swapaxes(0, 1), scale, jnp.float8_e4m3fn)
    vq = reference.quantize_kv(vp.reshape(KV, -1, D).swapaxes(0, 1), scale, jnp.float8_e4m3fn)
    k8, v8 = (x.swapaxes(0, 1).reshape(kp.shape) for x in (kq, vq))
    v8 = v8.swapaxes(2, 3)  # V keys-last, as the cache stores float8 pages
    s = dict(k_scale=scale, v_scale=scale)
    rows = {}
    variants = [("bf16", {}, (q, kp, vp, lens, table), {}),
                ("fp8", s, (q, k8, v8, lens, table), {})]
    # Float8 pages halve the bytes but not the work on each tile (the upcast, the softmax of
    # block_rows padded rows): fewer rows per program may suit them.
    for rows_, block_k, stages in [(64, 128, 3), (16, 64, 3), (16, 128, 3), (16, 128, 4),
                                   (16, 256, 3), (32, 128, 3), (16, 64, 5)]:
        variants.append((f"fp8 rows={rows_} block_k={block_k} stages={stages}", s,
                         (q, k8, v8, lens, table),
                         dict(block_rows=rows_, block_k=block_k, num_stages=stages)))
    variants.append(("bf16 rows=16 block_k=64 stages=3", {}, (q, kp, vp, lens, table),
                     dict(block_rows=16, block_k=64, num_stages=3)))
    for name, opts, args, tiles in variants:
        kw = dict(opts, **({"block_rows": tiles["block_rows"],
                            "pages_per_block": tiles["block_k"] // PAGE,
                            "num_stages": tiles["num_stages"]} if tiles else {}))
        fn = lambda q, kp, vp, c, t, kw=kw: K.paged_attention(q, kp, vp, c, t, impl="pallas",
                                                              interpret=SMOKE["on"], **kw)
        ref = lambda q, kp, vp, c, t, o=opts: reference.paged_attention_reference(
            q, kp, vp, c, t, **o)
        try:
            err, ok = checked(name, fn, args, ref, 2e-2, log)
        except jax.errors.JaxRuntimeError as e:  # e.g. tiles past the shared memory
            log(f"  {name}: does not run ({str(e).splitlines()[0][:100]})")
            continue
        ms = time_ms(fn, *args)
        kv_bytes = 2 * B * ctx * KV * D * args[1].dtype.itemsize
        tbps = kv_bytes / (ms / 1e3) / 1e12
        rows[name] = dict(ms=ms, tbps=tbps, frac_of_copy_bw=tbps / ceiling, rel_err=err,
                          ok=ok, kv_bytes=kv_bytes, tiles=tiles or "default")
        log(f"  {name}: {ms:.3f} ms, {tbps:.2f} TB/s, {100 * tbps / ceiling:.0f}% of copy")
    del kp, vp, k8, v8
    best = min((r for n, r in rows.items() if n.startswith("fp8")), key=lambda r: r["ms"])
    return dict(kernel="paged_attention", mode="decode_kernel", batch=B, context=ctx,
                heads=H, kv_heads=KV, head_dim=D, page_size=PAGE, kv_dtype="float8_e4m3fn",
                scales="per KV head", variants=rows,
                frac_of_copy_bw=rows["fp8"]["frac_of_copy_bw"],
                best_fp8_frac_of_copy_bw=best["frac_of_copy_bw"],
                speedup_vs_bf16=rows["bf16"]["ms"] / rows["fp8"]["ms"])


def window_decode(log, B=8, ctx=32768, window=4096, short=4096):
    out = {}
    for name, c, w in [("window 4k of 32k", ctx, window), ("full 4k", short, None)]:
        name = name if not SMOKE["on"] else name.replace("4k", str(window)).replace(
            "32k", str(ctx))
        args = decode_inputs(jax.random.PRNGKey(2), B, c)
        fn = lambda q, kp, vp, l, t, w=w: K.paged_attention(q, kp, vp, l, t, impl="pallas",
                                                            sliding_window=w,
                                                            interpret=SMOKE["on"])
        ref = lambda q, kp, vp, l, t, w=w: reference.paged_attention_reference(
            q, kp, vp, l, t, sliding_window=w)
        err, ok = checked(name, fn, args, ref, 2e-2, log)
        out[name] = dict(ms=time_ms(fn, *args), context=c, window=w, rel_err=err, ok=ok)
        log(f"  {name}: {out[name]['ms']:.4f} ms")
        del args
    ratio = out[next(iter(out))]["ms"] / out[list(out)[1]]["ms"]
    return dict(kernel="paged_attention_window", batch=B, context=ctx, window=window,
                heads=H, kv_heads=KV, head_dim=D, page_size=PAGE, dtype="bfloat16",
                runs=out, ratio_vs_full_4k=ratio, target_ratio=1.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in Pallas's interpreter: checks the script, not the GPU")
    args = ap.parse_args()
    SMOKE["on"] = args.smoke
    log = lambda msg: print(msg, flush=True)
    t0 = time.perf_counter()
    ceiling = copy_tbps() if not args.smoke else 1.0
    log(f"copy ceiling {ceiling:.2f} TB/s (read + written), {jax.devices()[0].device_kind}")
    log("fp8 KV decode, batch 64, context 4k")
    fp8 = fp8_decode(log, ceiling, *((2, 96) if args.smoke else ()))
    log("sliding-window decode, batch 8")
    win = window_decode(log, *((2, 200, 48, 48) if args.smoke else ()))
    meta = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
                date=datetime.date.today().isoformat(), copy_tbps=ceiling,
                seconds=time.perf_counter() - t0)
    records = [dict(meta, **fp8), dict(meta, **win)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_features.json").write_text(json.dumps(records, indent=1))
    print()
    print(f"| paged decode B=64 ctx 4k | ms | TB/s | of copy | rel err |")
    print(f"|---|---|---|---|---|")
    for n, r in fp8["variants"].items():
        print(f"| {n} | {r['ms']:.3f} | {r['tbps']:.2f} | {100 * r['frac_of_copy_bw']:.0f}% | "
              f"{r['rel_err']:.1e} |")
    print(f"fp8 vs bf16: {fp8['speedup_vs_bf16']:.2f}x faster; fp8 of copy "
          f"{100 * fp8['frac_of_copy_bw']:.0f}% (target >= 85%)")
    print()
    print(f"| decode B=8 | ms | rel err |")
    print(f"|---|---|---|")
    for n, r in win["runs"].items():  # the window run first
        print(f"| {n} | {r['ms']:.4f} | {r['rel_err']:.1e} |")
    print(f"window 4k of 32k / full 4k: {win['ratio_vs_full_4k']:.2f}x (target <= 1.2x)")
    print(f"{meta['seconds']:.0f} s")
    if not all(r["ok"] for r in list(fp8["variants"].values()) + list(win["runs"].values())):
        raise SystemExit("a kernel disagreed with the reference")


if __name__ == "__main__":
    main()
