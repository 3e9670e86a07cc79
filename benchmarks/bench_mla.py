"""GPU benchmark of the MLA decode kernel (`kernels/mla_decode.py`) at DeepSeek-V3's shapes.

  python -m benchmarks.bench_mla --out DIR          (~2 minutes on an H100)
  python -m benchmarks.bench_mla --out DIR --smoke  (tiny shapes in the interpreter, any machine)

Batch 64, context 4096, 128 query heads, kv_lora_rank 512, RoPE 64, bf16 pages of 64 tokens
shuffled over the page tables. Each tile shape in a small sweep whose estimated shared memory
fits (`mla_decode.smem_bytes`; the others are listed as skipped) is first checked against the
jnp reference on fresh random inputs (device memory filled with NaN before each call), then
timed: the median GPU time of its kernels (profiler trace, L2 flushed before each call;
`benchmarks/common.device_ms`) after warm-up. Bandwidth counts the latent bytes read once
(latent + RoPE key per token); the baseline is a device copy of those same bytes timed the same
way in the same run (bytes read + written), and the jnp absorbed decode (the reference) is
timed too. Writes DIR/mla_decode.json (`kernel: "mla_decode"`, the best shape) and prints a
table with the best shape and the `kernels.mla_decode_blocks` default it implies. Target:
>= 80% of the copy's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import common
from pallasite import kernels
from pallasite.kernels import mla_decode as M

SHAPE = dict(batch=64, context=4096, heads=128, kv_lora_rank=512, rope=64, page_size=64)
SMOKE_SHAPE = dict(batch=2, context=40, heads=16, kv_lora_rank=32, rope=16, page_size=8)
# (block_h, block_k tokens, num_warps, num_stages, v_parts) per run; the first is the library
# default (`kernels.mla_decode_blocks`), the second the previous one. With the page-table read
# taking stages of its own, tiles overlap the MMAs only from 5 stages on (3 buffers); 64-token
# tiles then exceed shared memory, so the sweep is mostly over 32- and 16-token tiles. With 8
# warps both warpgroups compute the same scores (Triton puts a chained dot's warps on its
# rows); v_parts 2 instead gives each of two 4-warp programs half the output columns.
SWEEP = [(64, 64, 8, 2, 1), (32, 64, 4, 2, 1), (64, 32, 8, 5, 1), (64, 32, 8, 3, 1),
         (64, 32, 8, 4, 1), (64, 32, 8, 6, 1), (64, 16, 8, 5, 1), (64, 16, 8, 7, 1),
         (64, 32, 4, 5, 2), (64, 16, 4, 5, 2), (64, 64, 4, 2, 2)]
TILE = ("block_h", "block_k", "num_warps", "num_stages", "v_parts")
SMEM_LIMIT = 232448  # bytes a Hopper block may opt into


def inputs(key, batch, context, heads, kv_lora_rank, rope, page_size, dtype=jnp.bfloat16):
    pps = -(-context // page_size)
    kq, kr, kl, kp, kt = jax.random.split(key, 5)
    q_lat = jax.random.normal(kq, (batch, heads, kv_lora_rank), dtype)
    q_pe = jax.random.normal(kr, (batch, heads, rope), dtype)
    latent = jax.random.normal(kl, (1, batch * pps, page_size, kv_lora_rank), dtype)
    rope_pages = jax.random.normal(kp, (1, batch * pps, page_size, rope), dtype)
    table = jax.random.permutation(kt, batch * pps).reshape(batch, pps).astype(jnp.int32)
    return q_lat, q_pe, latent, rope_pages, jnp.full((batch,), context, jnp.int32), table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in Pallas's interpreter: checks the script, not the GPU")
    args = ap.parse_args()
    t0 = time.perf_counter()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    sm_scale = (128 + shape["rope"]) ** -0.5
    args_ = inputs(jax.random.PRNGKey(0), **shape)
    lat_bytes = sum(x.size * x.dtype.itemsize for x in args_[2:4])
    timed = (lambda fn, *a: 0.0) if args.smoke else (
        lambda fn, *a: common.time_ms(fn, *a, device=True))
    ref = jax.jit(lambda *a: M.mla_decode_reference(*a, sm_scale=sm_scale))
    want = ref(*args_)
    copy_ms = timed(lambda lat, rope: (lat * 1, rope * 1), *args_[2:4])
    copy_tbps = 2 * lat_bytes / max(copy_ms, 1e-9) / 1e9
    ref_ms = timed(ref, *args_)
    print(f"{jax.devices()[0].device_kind}: latent bytes {lat_bytes / 2**20:.0f} MiB; copy of "
          f"them {copy_ms:.3f} ms = {copy_tbps:.2f} TB/s (read + written); jnp reference "
          f"{ref_ms:.3f} ms", flush=True)
    runs = []
    assert kernels.mla_decode_blocks(SHAPE["heads"]) == dict(zip(TILE, SWEEP[0])), \
        "SWEEP[0] is the library default"
    runs = []
    for tile in SWEEP[:2] + SWEEP[-1:] if args.smoke else SWEEP:
        row = dict(zip(TILE, tile))
        row["smem"] = M.smem_bytes(row["block_h"], row["block_k"], shape["kv_lora_rank"],
                                   shape["rope"], row["num_stages"])
        if row["smem"] > SMEM_LIMIT:
            row.update(ok=None, error=f"skipped: ~{row['smem']} bytes of shared memory")
            runs.append(row)
            print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            continue
        kw = dict(sm_scale=sm_scale, interpret=args.smoke, **dict(zip(TILE, tile)))
        fn = jax.jit(lambda *a, kw=kw: M.mla_decode(*a, **kw))
        try:
            if not args.smoke:
                common.poison()
            row["rel_err"] = common.rel_err(fn(*args_), want)
            row["ok"] = row["rel_err"] <= 2e-2
            row["ms"] = timed(fn, *args_)
        except Exception as e:  # a tile shape this GPU cannot compile: recorded, not fatal
            row.update(ok=False, error=repr(e)[:300])
        if "ms" in row:
            row["tbps"] = lat_bytes / max(row["ms"], 1e-9) / 1e9
            row["frac_of_copy_bw"] = row["tbps"] / copy_tbps
        runs.append(row)
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
    good = [r for r in runs if r.get("ok") and "ms" in r]
    best = min(good, key=lambda r: r["ms"]) if good else None
    record = dict(common.run_info(), kernel="mla_decode", **shape, dtype="bfloat16",
                  latent_bytes=lat_bytes, copy_ms=copy_ms, copy_tbps=copy_tbps,
                  reference_ms=ref_ms, runs=runs, best=best, target_frac_of_copy_bw=0.8,
                  seconds=time.perf_counter() - t0)
    if best:
        record.update(ms=best["ms"], tbps=best["tbps"], frac_of_copy_bw=best["frac_of_copy_bw"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mla_decode.json").write_text(json.dumps(record, indent=1))
    print()
    print("| mla_decode B=64 ctx 4k, 128 heads, 512+64 | smem KiB | ms | TB/s | of copy "
          "| rel err |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        name = f"block_h {r['block_h']}, {r['block_k']} keys, {r['num_warps']}w/" \
               f"{r['num_stages']}s" + (f", {r['v_parts']} parts" if r["v_parts"] > 1 else "")
        if "ms" in r:
            print(f"| {name} | {r['smem'] // 1024} | {r['ms']:.3f} | {r['tbps']:.2f} | "
                  f"{100 * r['frac_of_copy_bw']:.0f}% | {r['rel_err']:.1e} |")
        else:
            print(f"| {name} | {r['smem'] // 1024} | {r.get('error', r.get('rel_err'))} "
                  f"| | | |")
    print(f"| copy of the latent bytes | | {copy_ms:.3f} | {copy_tbps:.2f} | 100% | |")
    print(f"| jnp reference | | {ref_ms:.3f} | {lat_bytes / max(ref_ms, 1e-9) / 1e9:.2f} | | |")
    if best:
        blocks = ", ".join(f"{k}={best[k]}" for k in TILE)
        print(f"best: {best['ms']:.3f} ms, {100 * best['frac_of_copy_bw']:.0f}% of copy -> "
              f"kernels.mla_decode_blocks(>= 64 heads) = dict({blocks})"
              f"{'' if best is runs[0] else ' (not the current default)'}")
    print(f"{record['seconds']:.0f} s")
    if best is None or any(r.get("ok") is False and "error" not in r for r in runs):
        raise SystemExit("the kernel disagreed with the reference (or no shape ran)")


if __name__ == "__main__":
    main()
