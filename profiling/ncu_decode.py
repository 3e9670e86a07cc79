"""Where a decode call's time goes: the device time of each kernel it launches (Nsight Compute)
beside the timed call, at the two decode targets (batch 1 / context 32k, batch 64 / 4k).

    python -m profiling.ncu_decode --time             # each call timed three ways
    ncu --clock-control none --profile-from-start off --csv --print-units base \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --log-file k.csv \\
        python -m profiling.ncu_decode
    python -m profiling.ncu_decode --summarize k.csv  # kernels per call, microseconds, bytes read

`--float8` profiles the Triton decode over bf16 pages and over float8 pages by `fp8_dot`
instead (B=64 at 4k, B=768 at 320), for Nsight's sections (occupancy, stalls, instructions).
One case with light sections finishes in about three minutes on an H100:

    ncu --clock-control none --profile-from-start off --kernel-name regex:'paged|marker' \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section SpeedOfLight -o f8 \
        python -m profiling.ncu_decode --float8 --cases b768_320
    ncu -i f8.ncu-rep --page details --csv > details.csv

Calls: our decode through `kernels.paged_attention` with each backend, JAX's Pallas paged kernel,
and an XLA sum over K and V (the floor of reading them once). Under ncu each call runs once
between cuProfilerStart/Stop, after a marker kernel named for it. GPU only.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import io

CASES = {"b1_32k": (1, 32768), "b64_4k": (64, 4096)}
FLOAT8_CASES = {"b64_4k": (64, 4096), "b768_320": (768, 320)}
H, KV, D = 32, 8, 128


def calls():
    import jax.numpy as jnp
    from benchmarks.attention import K, jax_paged_reference

    def read(q, kp, vp, ctx, table):  # both pools read once, nothing else
        s = jnp.sum(kp, dtype=jnp.float32) + jnp.sum(vp, dtype=jnp.float32)
        return q * 0 + s.astype(q.dtype)
    return {
        "triton": lambda *a: K.paged_attention(*a, backend="triton"),
        "mosaic": lambda *a: K.paged_attention(*a, backend="mosaic"),
        "jax_paged": jax_paged_reference,
        "xla_read": read,
    }


def float8_calls():
    """`--float8`: the Triton decode over bf16 pages and over their float8 form, by fp8_dot."""
    from pallasite import kernels as K
    from pallasite.kernels import paged, tuning
    tiles = {k: v for k, v in tuning.params("decode_fp8", 16).items() if k != "fp8_dot"}
    one = lambda dot: lambda q, kp, vp, lens, table, sc: paged.paged_attention(
        q, kp, vp, lens, table, **sc, **tiles, fp8_dot=dot)
    return {"bf16": lambda q, kp, vp, lens, table, sc: K.paged_attention(
        q, kp, vp, lens, table, backend="triton"),
        "fp8_f16": one("f16"), "fp8_e4m3": one("e4m3")}


def float8_inputs(batch, ctx):
    """q, pages and scales: bf16 for the call named "bf16", float8 for the others."""
    import jax
    from benchmarks.sweep_fp8kv import inputs as fp8_inputs
    q, pages16, pages8, sc, lens, table = fp8_inputs(jax.random.PRNGKey(0), batch, ctx, ctx)
    return {"bf16": (q, *pages16, lens, table, {}), "fp8": (q, *pages8, lens, table, sc)}


def inputs(batch, ctx):
    import jax.numpy as jnp
    import numpy as np
    from benchmarks.attention import paged_inputs
    q, kp, vp, _, lens, table = paged_inputs(np.random.default_rng(0), [1] * batch,
                                             [ctx] * batch, H, KV, D, 16, jnp.bfloat16)
    return q.reshape(batch, H, D), kp, vp, lens, table


def marker(name):
    """A one-program kernel whose name shows in the profile."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)
    return jax.jit(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                                  name=name))


def profiled(float8=False, only=None):
    import jax
    cuda = ctypes.CDLL("libcuda.so.1")
    for case, (batch, ctx) in (FLOAT8_CASES if float8 else CASES).items():
        if only and case not in only:
            continue
        both = float8_inputs(batch, ctx) if float8 else None
        for name, fn in (float8_calls() if float8 else calls()).items():
            args = both["bf16" if name == "bf16" else "fp8"] if float8 else inputs(batch, ctx)
            f, mark = jax.jit(fn), marker(f"marker_{case}_{name}")
            jax.block_until_ready((f(*args), mark()))
            cuda.cuProfilerStart()
            jax.block_until_ready(mark())
            jax.block_until_ready(f(*args))
            cuda.cuProfilerStop()


def timed():
    from benchmarks.common import time_ms
    print("| case | call | device ms | dispatch ms | fori_loop ms |\n|---|---|---|---|---|")
    for case, (batch, ctx) in CASES.items():
        args = inputs(batch, ctx)
        for name, fn in dict(calls(), trivial=lambda q, *a: q * 2).items():
            one = time_ms(fn, *args, reps=21, device=True)
            dispatch = time_ms(fn, *args, reps=21, inner=50)
            fori = time_ms(fn, *args, reps=21, loop=True)
            print(f"| {case} | {name} | {one:.4f} | {dispatch:.4f} | {fori:.4f} |", flush=True)


def summarize(path):
    """Kernels of each call (after its marker): name, microseconds, MB read; then the totals."""
    text = open(path).read()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels = collections.OrderedDict()
    for r in rows:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})
        value = float(r["Metric Value"].replace(",", ""))  # base units: ns, bytes
        if r["Metric Name"].startswith("gpu__time_duration"):
            k["us"] = value * 1e-3
        elif r["Metric Name"].startswith("dram__bytes_read"):
            k["mb"] = value * 1e-6
    call = None
    for k in kernels.values():
        if k["name"].startswith("marker_"):
            call = k["name"][len("marker_"):]
            print(f"\n{call}")
            continue
        print(f"  {k.get('us', 0):9.2f} us {k.get('mb', 0):9.1f} MB  {k['name'][:70]}")
    totals = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for k in kernels.values():
        if k["name"].startswith("marker_"):
            call = k["name"][len("marker_"):]
        elif call:
            t = totals[call]
            t[0] += k.get("us", 0)
            t[1] += k.get("mb", 0)
            t[2] += 1
    print("\n| call | kernels | device us | MB read | TB/s |\n|---|---|---|---|---|")
    for call, (us, mb, n) in totals.items():
        print(f"| {call} | {n} | {us:.2f} | {mb:.1f} | {mb / us if us else 0:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--summarize", metavar="CSV")
    ap.add_argument("--float8", action="store_true",
                    help="profile the Triton decode over bf16 and float8 pages instead")
    ap.add_argument("--cases", default=None,
                    help="comma-separated case names to profile (default: all); under ncu "
                         "every CUDA call is slower: a whole --float8 run did not finish in "
                         "400 s")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.time:
        timed()
    else:
        profiled(args.float8, args.cases and args.cases.split(","))


if __name__ == "__main__":
    main()
