"""The bf16 plain products of a large step (Llama-3-8B layer shapes, M = 256-1024 rows: a paced
offline step and the big decode steps of a ShareGPT run) as the engine runs them, XLA's dot
(cuBLAS, autotuned by XLA), against JAX's warp-specialized Hopper matmul on Mosaic GPU
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`) over a set of tiles: is there a tiling
that reads the weights faster at the ridge, where the products take as long as their read?
`--form int8` times JAX's mixed-type Hopper matmul (`hopper_mixed_type_matmul_mgpu`: INT8
weights made bf16 in registers as the MMA's left operand, the activations' transpose in shared
memory, warp-specialized) on the same shapes, beside the same XLA bf16 product: what a
weight-only kernel of that design reaches at these rows (no scales: an upper bound on the form).

    python -m benchmarks.bench_gemm --out DIR           # H100
    python -m benchmarks.bench_gemm --out DIR --shapes gate_up --ms 256 --tiles A,B
    python -m benchmarks.bench_gemm --out DIR --form int8 --ms 128,256

Each tile is first checked against XLA's product on other random inputs, the freed device
memory poisoned (relative error <= 1e-2); one that fails to compile or to match is recorded and
not timed. Times are the median GPU time over --reps calls, the L2 flushed before each
(`common.device_times`), with the weights' read rate (TB/s) and the FLOP rate. Writes
DIR/bench_gemm.json and prints a table: XLA, the best tile, and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common

SHAPES = dict(qkv=(4096, 6144), o=(4096, 4096), gate_up=(4096, 28672), down=(14336, 4096))
# name: (tile_m, tile_n, the dimension its two consumer warpgroups split, cluster dimension).
# A CTA covers twice the tile along the split dimension; a cluster of two shares one operand's
# tile by multicast (M: the weights', N: the activations').
TILES = dict(A=(128, 128, "M", None), B=(128, 128, "N", None), C=(64, 256, "M", None),
             D=(64, 128, "M", None), E=(128, 64, "M", None), F=(64, 256, "N", None),
             G=(64, 128, "N", None), AM=(128, 128, "M", "M"), AN=(128, 128, "M", "N"),
             CN=(64, 256, "M", "N"))
# The int8 form's tiles: the kernel's M is the weights' output columns, its N the rows (tokens).
INT8_TILES = dict(I1=(64, 256, "M", None), I2=(128, 128, "N", None), I3=(64, 128, "M", None),
                  I4=(128, 128, "M", None), I5=(64, 128, "N", None), I6=(64, 64, "M", None))
SMEM = 200 * 1024  # of the SM's 227 KiB for the pipeline, the rest for the epilogue's tiles


def config(name: str, k: int):
    """The TuningConfig of tile `name` (pipeline depth: as many K steps as fit, at most 4)."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as plain
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed
    hm = mixed if name in INT8_TILES else plain
    tm, tn, wg, cluster = {**TILES, **INT8_TILES}[name]
    cta_m, cta_n = tm * (1 + (wg == "M")), tn * (1 + (wg == "N"))
    a_bytes = 1 if name in INT8_TILES else 2
    steps = max(2, min(4, SMEM // ((cta_m * a_bytes + cta_n * 2) * 64), k // 64))
    fields = {f.name for f in dataclasses.fields(hm.TuningConfig)}
    kw = dict(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps, epi_tile_m=64,
              epi_tile_n=64, grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=1,
              wg_dimension=hm.MatmulDimension[wg],
              cluster_dimension=cluster and hm.MatmulDimension[cluster])
    return hm.TuningConfig(**{k_: v for k_, v in kw.items() if k_ in fields})


def fits(name: str, m: int, n: int) -> bool:
    tm, tn, wg, cluster = {**TILES, **INT8_TILES}[name]
    if name in INT8_TILES:  # the kernel's M and N: the weights' columns and the rows
        m, n = n, m
    cm = tm * (1 + (wg == "M")) * (1 + (cluster == "M"))
    cn = tn * (1 + (wg == "N")) * (1 + (cluster == "N"))
    return m % cm == 0 and n % cn == 0


def xla_dot(x, w):
    return jnp.matmul(x, w, preferred_element_type=jnp.bfloat16)  # as kernels.matmul runs it


def mosaic(name: str, k: int):
    """The jitted call of tile `name`: x [M, K] and the form's weights -> [M, N]."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as hmix
    cfg = config(name, k)
    if name in INT8_TILES:  # w: the INT8 weights' transpose [N, K]; out^T = w x^T
        return jax.jit(lambda x, w: hmix.mixed_matmul_kernel(
            w, x.T, out_dtype=jnp.bfloat16, config=cfg).T)
    return jax.jit(lambda x, w: hm.matmul(x, w, None, cfg))


def inputs(m: int, k: int, n: int, seed: int, form: str = "bf16"):
    """x [m, k] and the weights: bf16 [k, n], or INT8 codes [n, k] for the int8 form."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    if form == "int8":
        x = x * (1 / (32 * float(np.sqrt(k))))
        return x, jax.random.randint(kw, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
    return x, (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)


def reference(x, w):
    """XLA's product of the same operands (the int8 form's weights made bf16 first)."""
    if w.dtype == jnp.int8:
        return xla_dot(x, w.T.astype(jnp.bfloat16))
    return xla_dot(x, w)


def one_shape(shape: str, m: int, args, env) -> list[dict]:
    """XLA's bf16 product and every tile of the form that fits, checked, then timed together."""
    k, n = SHAPES[shape]
    x, w = inputs(m, k, n, 0)  # XLA's bf16 product is the baseline of either form
    calls, names, records = [(jax.jit(xla_dot), (x, w))], ["xla"], []
    if args.form == "int8":
        x, w = inputs(m, k, n, 0, "int8")
    for t in (t for t in args.tiles.split(",") if fits(t, m, n)):
        rec = dict(env, shape=shape, m=m, k=k, n=n, tile=t)
        try:
            f = mosaic(t, k)
            common.poison()
            xc, wc = inputs(m, k, n, 1, args.form)
            rec["rel_err"] = common.rel_err(f(xc, wc), reference(xc, wc))
        except Exception as e:  # noqa: BLE001 -- recorded, not timed
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if rec.get("rel_err", 1.0) <= 1e-2:
            calls.append((f, (x, w)))
            names.append(t)
        else:
            records.append(rec)
    times = common.device_times(calls, args.reps)
    for t, (ms, kernels) in zip(names, times):
        wbytes = k * n * (1 if t in INT8_TILES else 2)
        rec = dict(env, shape=shape, m=m, k=k, n=n, tile=t, ms=ms, vs_xla=times[0][0] / ms,
                   weight_tbps=wbytes / (ms * 1e-3) / 1e12,
                   tflops=2 * m * k * n / (ms * 1e-3) / 1e12, kernels=kernels[:4])
        if t != "xla":
            rec["config"] = str(config(t, k))
        records.append(rec)
    return records


def table(records) -> str:
    lines = ["| shape | M | XLA us | TB/s | best tile | us | TB/s | TFLOP/s | vs XLA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in records):
        rs = [r for r in records if r["shape"] == shape and r["m"] == m and "ms" in r]
        xla = [r for r in rs if r["tile"] == "xla"]
        best = min((r for r in rs if r["tile"] != "xla"), key=lambda r: r["ms"], default=None)
        if xla and best:
            lines.append(f"| {shape} | {m} | {1e3 * xla[0]['ms']:.1f} | "
                         f"{xla[0]['weight_tbps']:.2f} | {best['tile']} | {1e3 * best['ms']:.1f} "
                         f"| {best['weight_tbps']:.2f} | {best['tflops']:.0f} | "
                         f"{best['vs_xla']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="256,512,1024")
    ap.add_argument("--tiles", default=None, help="default: every tile of the form")
    ap.add_argument("--form", choices=["bf16", "int8"], default="bf16")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    args.tiles = args.tiles or ",".join(INT8_TILES if args.form == "int8" else TILES)
    env = dict(common.run_info(), form=args.form)
    print(json.dumps(env), flush=True)
    records = []
    for shape in args.shapes.split(","):
        for m in (int(x) for x in args.ms.split(",")):
            for rec in one_shape(shape, m, args, env):
                records.append(rec)
                print(json.dumps(rec), flush=True)
            os.makedirs(args.out, exist_ok=True)  # kept after each shape, should a later hang
            with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
                json.dump(records, f, indent=1)
    print("\n" + table(records))


if __name__ == "__main__":
    main()
