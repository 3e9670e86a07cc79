"""Can a decode step's attention run beside its matrix products? Two halves of a 768-row
decode batch, as a two-batch overlap would split them: half A's attention over paged K/V
(memory-bound) and half B's MLP (compute-bound), chained through L layers.

  python -m benchmarks.overlap --out DIR            (GPU, about a minute)
  python -m benchmarks.overlap --out DIR --tiny     (CPU: checks the script)

Variants, each one jitted program of L layers timed by wall clock (`common.host_ms`, the
median of `--reps` calls):
- "attn" / "mlp": one chain alone;
- "serial": both chains in one program, on XLA's one compute stream;
- "stream": the attention chain on a second stream (`jax.experimental.compute_on` with
  `compute_type="gpu_stream:1"`), which XLA is to run as async work beside the MLP chain (in
  JAX 0.11.2 it fails at run time: `No ExecutionStreamId found for call-start`);
- "stream_mlp": the MLP chain on the second stream instead.
Run under `XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, "serial" is one CUDA
graph whose two chains are independent branches, which the GPU may run side by side (XLA's
default mode, LHS, orders them as its scheduler did).
The overlap gained is (attn + mlp - variant) / min(attn, mlp): 0 is serial, 1 is perfect.

`--clocks` also runs one GEMM shape back to back for a few seconds while `nvidia-smi` samples
the SM clock and the power draw: whether the products' rate at large M is held by the clock.
Writes DIR/overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.attention import K, paged_inputs

D, F, H, KV, HD = 4096, 14336, 32, 8, 128


def on_stream(fn, stream):
    """fn's work on XLA's compute stream `stream` (None: the default one)."""
    if stream is None:
        return fn
    import inspect
    from jax._src.core import MemorySpace
    from jax.experimental import compute_on as co
    # Newer JAX: `compute_on(f, *, compute_type, out_memory_spaces)`; older: `compute_on2`.
    wrap = getattr(co, "compute_on2", None)
    if wrap is None and "out_memory_spaces" in inspect.signature(co.compute_on).parameters:
        wrap = co.compute_on
    if wrap is None:
        raise NotImplementedError("this JAX has no compute_on for a function")
    return wrap(fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=MemorySpace.Device)


def program(layers, variant, attn_args, mlp_args, impl, backend=None):
    q0, kp, vp, ctx, table = attn_args
    x0, w_gu, w_down = mlp_args

    def attn(q):
        out = K.paged_attention(q, kp, vp, ctx, table, impl=impl, backend=backend)
        return q + out * 0.01

    def mlp(x):
        gu = jnp.dot(x, w_gu, preferred_element_type=jnp.float32).astype(x.dtype)
        g, u = jnp.split(gu, 2, axis=-1)
        return x + 0.01 * jnp.dot(jax.nn.silu(g) * u, w_down,
                                  preferred_element_type=jnp.float32).astype(x.dtype)

    a_stream = 1 if variant == "stream" else None
    m_stream = 1 if variant == "stream_mlp" else None
    attn_l, mlp_l = on_stream(attn, a_stream), on_stream(mlp, m_stream)

    @jax.jit
    def run(q, x):
        for _ in range(layers):
            if variant != "mlp":
                q = attn_l(q)
            if variant != "attn":
                x = mlp_l(x)
        return q, x
    call = lambda: run(q0, x0)
    call.hlo = lambda: run.lower(q0, x0).compile().as_text()
    return call


def clocks(m, seconds=4.0):
    """TFLOP/s of an [m, D] x [D, 2F] product run back to back, with nvidia-smi's samples."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(k1, (m, D), jnp.bfloat16)
    w = jax.random.normal(k2, (D, 2 * F), jnp.bfloat16) * 0.02
    f = jax.jit(lambda x, w: jnp.dot(x, w))
    jax.block_until_ready(f(x, w))
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True).stdout.strip().split(",")
            samples.append([float(v) for v in out])
            time.sleep(0.2)
    t = threading.Thread(target=sample)
    t.start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready([f(x, w) for _ in range(20)][-1])
        n += 20
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
    s = np.array(samples[2:] or samples)
    return dict(m=m, tflops=2 * m * D * 2 * F * n / dt / 1e12, sm_mhz=float(np.median(s[:, 0])),
                watts=float(np.median(s[:, 1])), temp_c=float(np.median(s[:, 2])))


def time_variants(a, attn_args, mlp_args, impl) -> dict:
    """Each variant's ms (None where XLA refused it), the overlap each gained, and whether the
    streamed variants computed what the serial one did."""
    res, outs = {}, {}
    for v in a.variants.split(","):
        try:
            call = program(a.layers, v, attn_args, mlp_args, impl, a.backend)
            outs[v] = jax.device_get(call())
            if v.startswith("stream") and not a.tiny:
                hlo = call.hlo()
                print(f"  {v:>10}: compiled with {hlo.count('async-start')} async starts, "
                      f"{hlo.count('_xla_stream_annotation')} stream annotations", flush=True)
            res[v] = common.host_ms(call, reps=a.reps)
            print(f"  {v:>10}: {res[v]:8.3f} ms ({res[v] / a.layers:.4f} a layer)", flush=True)
        except Exception as e:  # a variant XLA refuses is a finding, not the end of the run
            res[v] = None
            print(f"  {v:>10}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    rec = dict(ms=res)
    if res.get("attn") and res.get("mlp"):
        both, least = res["attn"] + res["mlp"], min(res["attn"], res["mlp"])
        rec["overlap"] = {v: (both - t) / least for v, t in res.items()
                          if t and v not in ("attn", "mlp")}
        for v, f in rec["overlap"].items():
            print(f"  overlap {v}: {f:.2f}", flush=True)
    if "serial" in outs:
        rec["same_as_serial"] = {v: bool(all(np.array_equal(np.asarray(a_, np.float32),
                                                          np.asarray(b_, np.float32))
                                             for a_, b_ in zip(o, outs["serial"])))
                                 for v, o in outs.items() if v.startswith("stream")}
        print(f"  outputs equal to serial: {rec['same_as_serial']}", flush=True)
    return rec


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, default=768, help="the whole batch; each half gets half")
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", default="attn,mlp,serial,stream,stream_mlp")
    p.add_argument("--backend", default=None, help="the paged kernel's: mosaic or triton")
    p.add_argument("--clocks", default="", help="row counts for the clock probe, e.g. 768,8192")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    global D, F, H, KV
    impl = None
    if a.tiny:
        D, F, H, KV = 128, 256, 4, 2
        a.rows, a.context, a.layers, a.reps, impl = 16, 48, 2, 2, "reference"
    half = a.rows // 2
    rng = np.random.default_rng(0)
    q, kp, vp, _, ctx, table = paged_inputs(rng, [1] * half, [a.context] * half, H, KV, HD, 16,
                                            jnp.bfloat16)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (half, D), jnp.bfloat16)
    w_gu = jax.random.normal(k2, (D, 2 * F), jnp.bfloat16) * D ** -0.5
    w_down = jax.random.normal(k3, (F, D), jnp.bfloat16) * F ** -0.5
    info = common.run_info(device=not a.tiny)
    print(f"{info.get('gpu')} JAX {jax.__version__}: {a.rows} rows ({half} a half), context "
          f"{a.context}, {a.layers} layers", flush=True)
    rec = dict(info, rows=a.rows, context=a.context, layers=a.layers, backend=a.backend,
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               **time_variants(a, (q, kp, vp, ctx, table), (x, w_gu, w_down), impl))
    if a.clocks and not a.tiny:
        rec["clocks"] = [clocks(int(m)) for m in a.clocks.split(",")]
        for c in rec["clocks"]:
            print(f"  clocks M={c['m']}: {c['tflops']:.0f} TFLOP/s, SM {c['sm_mhz']:.0f} MHz, "
                  f"{c['watts']:.0f} W, {c['temp_c']:.0f} C", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "overlap.json").write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
