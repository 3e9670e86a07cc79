"""What every benchmark and profiler shares: the header of a JSON record (GPU, date, JAX
version, the command that made it), how a call is timed (host wall clock, or the GPU time of the
kernels it launches, read from a profiler trace with the L2 flushed before each call), the copy
bandwidth that bounds a memory-bound kernel, and the error against a reference.
"""

from __future__ import annotations

import datetime
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def command() -> str:
    """How this process was started, as a reader would type it (`python -m benchmarks.X ...`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def run_info(device: bool = True) -> dict:
    """The keys every record carries: gpu, jax_version (with `device`), date (UTC), command."""
    info = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__) if device else {}
    return info | dict(date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
                       command=command())


# ---------------------------------------------------------------- timing

def override_tuning(entries: list[str]):
    """Replace entries of this GPU's tuning table for this process, each "NAME=JSON" (null drops
    the entry): an earlier setting timed beside the table's in one call."""
    import json
    from pallasite.kernels import tuning
    table = tuning.TABLE[tuning.gpu_key()] = dict(tuning.TABLE[tuning.gpu_key()])
    for entry in entries:
        name, _, value = entry.partition("=")
        value = json.loads(value)
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value


def host_ms(fn, *args, reps=30):
    """Median wall-clock ms of `fn(*args)` after one warm-up call, each call waited for."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def time_ms(fn, *args, reps=15, inner=None, loop=False, device=False, chain=False):
    """Median ms per call. `device=True`: the GPU time of the kernels one call launches
    (`device_ms`). `loop=True` runs `inner` calls inside one jitted fori_loop, each input
    hanging on one element of the last output (the whole output is carried: unrolled calls let
    XLA drop all but that element); its iterations cost 20-40 us of their own on the H100
    (`profiling/ncu_decode.py --time`, "trivial"). Otherwise `inner` jitted calls from the host."""
    if device:
        return device_ms(fn, *args, reps=reps, chain=chain)
    if loop:
        inner = inner or 20

        @jax.jit
        def many(*args):
            def body(i, acc):
                q = args[0] + (acc[(0,) * acc.ndim] * 0).astype(args[0].dtype)
                return fn(q, *args[1:]).astype(acc.dtype)
            out0 = fn(*args)
            return jax.lax.fori_loop(0, inner, body, out0)
        call = lambda: many(*args)
    else:
        inner = inner or 5
        jf = jax.jit(fn)
        call = lambda: [jf(*args) for _ in range(inner)][-1]
    jax.block_until_ready(call())
    jax.block_until_ready(call())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append((time.perf_counter() - t0) / (inner + (1 if loop else 0)))
    return 1e3 * float(np.median(ts))


FLUSH = "bench_l2_flush"  # the kernel that separates calls in a trace


# How l2_flush evicts the L2 (--flush). "read" since 2026-11-23: after the write flush the
# timed call also wrote back the flush's dirty lines, which charged a bandwidth-bound kernel
# more than a slower one (H100, decode B=64 / 4k: ours +10 us, JAX's paged kernel +3 us;
# profiling/probe_flush.py). A model step's attention follows kernels that leave little dirty.
FLUSH_MODE = {"mode": "read"}


def l2_flush():
    """A jitted Pallas kernel (named FLUSH) that writes 128 MB, more than any GPU's L2, or with
    FLUSH_MODE "read" reads 128 MB (and writes 2 MB): the L2 is then left clean, so the timed
    call does not also write back the flush's dirty lines."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    blocks = pl.BlockSpec((64, 256), lambda i: (i, 0))  # 2048 of them: 128 MB of float32
    call = lambda kernel, **kw: jax.jit(pl.pallas_call(
        kernel, grid=(2048,), compiler_params=plgpu.CompilerParams(num_warps=8), name=FLUSH,
        **kw))
    if FLUSH_MODE["mode"] == "read":  # a row of column sums out per block
        def read(x_ref, o_ref):
            o_ref[...] = jnp.sum(x_ref[...], axis=0, keepdims=True)
        buf = jnp.ones((2048 * 64, 256), jnp.float32)
        f = call(read, in_specs=[blocks], out_specs=pl.BlockSpec((1, 256), lambda i: (i, 0)),
                 out_shape=jax.ShapeDtypeStruct((2048, 256), jnp.float32))
        return lambda: f(buf)

    def write(o_ref):
        o_ref[...] = jnp.ones_like(o_ref)
    return call(write, out_specs=blocks, out_shape=jax.ShapeDtypeStruct((2048 * 64, 256),
                                                                         jnp.float32))


def traced(run):
    """(run()'s result, the `ProfileData` of a `jax.profiler` trace taken around it)."""
    import glob
    import tempfile
    from jax.profiler import ProfileData
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        out = run()
        jax.profiler.stop_trace()
        return out, ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])


def device_ms(fn, *args, reps=15, chain=False, compiled=False):
    """Median over `reps` calls of the summed GPU time of the kernels one call launches, read
    from a profiler trace (CUPTI): no host dispatch or launch gaps, which a model step's
    compiled program mostly hides. The L2 is flushed before each call (`l2_flush`), so inputs
    smaller than the cache are read from memory as in a real step. The call's kernels go to
    DEVICE_KERNELS.
    `chain`: the first argument is donated and each call's output is the next call's first
    argument (an in-place update, as the serving step runs it). `compiled`: fn is already a
    compiled executable (`jax.jit(...).lower(...).compile(...)`), called as it is."""
    jf = fn if compiled else jax.jit(fn, donate_argnums=(0,) if chain else ())
    flush = l2_flush()

    def call():
        nonlocal args
        out = jf(*args)
        if chain:
            args = (out, *args[1:])
        return out
    jax.block_until_ready((call(), flush()))

    def run():
        for _ in range(reps):
            jax.block_until_ready(flush())
            jax.block_until_ready(call())
    _, data = traced(run)
    lines = [(p.name, line.name, line.events) for p in data.planes for line in p.lines]
    ms, DEVICE_KERNELS[:] = per_call_ms(lines, reps)
    return ms


def device_times(calls, reps):
    """[(median ms, kernel names of one call)] for each (fn, args), all in one profiler trace,
    the L2 flushed before every call. On CPU: host wall clock, no names."""
    if jax.default_backend() != "gpu":
        return [(host_ms(fn, *args, reps=reps), []) for fn, args in calls]
    flush = l2_flush()
    for fn, args in calls:
        jax.block_until_ready((fn(*args), flush()))

    def run():
        for fn, args in calls:
            for _ in range(reps):
                jax.block_until_ready(flush())
                jax.block_until_ready(fn(*args))
    _, data = traced(run)
    events = sorted((e.start_ns, e.duration_ns, e.name) for p in data.planes for line in p.lines
                    if p.name.startswith("/device:GPU") and line.name.startswith("Stream")
                    for e in line.events)
    per_call = []
    for _, ns, name in events:
        if FLUSH in name:
            per_call.append([0.0, []])
        elif per_call:
            per_call[-1][0] += ns
            per_call[-1][1].append(name)
    if len(per_call) != reps * len(calls):
        raise RuntimeError(f"{len(per_call)} flushes in the trace for {reps * len(calls)} calls")
    return [(1e-6 * float(np.median([c[0] for c in per_call[i * reps:(i + 1) * reps]])),
             per_call[(i + 1) * reps - 1][1]) for i in range(len(calls))]


def per_call_ms(lines, reps):
    """(median ms, kernel names of the last call) from a trace's (plane, line, events): the
    GPU's stream lines, cut into calls at each FLUSH kernel."""
    events = sorted((e.start_ns, e.duration_ns, e.name) for plane, line, evs in lines
                    if plane.startswith("/device:GPU") and line.startswith("Stream")
                    for e in evs)
    calls, names = [], []
    for _, ns, name in events:
        if FLUSH in name:
            calls.append(0.0)
            names = []
        elif calls:
            calls[-1] += ns
            names.append(name)
    if len(calls) != reps:
        raise RuntimeError(f"{len(calls)} flushes for {reps} calls in the trace; lines: "
                           f"{sorted({(p, l) for p, l, _ in lines})[:12]}")
    return 1e-6 * float(np.median(calls)), names


DEVICE_KERNELS: list[str] = []


# ---------------------------------------------------------------- ceilings and errors

def torch_copy_bps(gb: float) -> float:
    """Bytes read + written per second by torch's device-to-device `copy_` (raises without
    torch or CUDA)."""
    import torch
    n = int(gb * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / float(np.median(times))


def copy_bandwidth(gb=4):
    """Bytes read + written per second by a device-to-device copy (torch if present, else jnp)."""
    try:
        return torch_copy_bps(gb), "torch copy_"
    except Exception:
        n = int(gb * 2**30) // 2
        x = jnp.ones((n,), jnp.bfloat16)
        f = jax.jit(lambda x: x + 1)
        f(x).block_until_ready()
        t = []
        for _ in range(20):
            s = time.perf_counter(); f(x).block_until_ready(); t.append(time.perf_counter() - s)
        return 2 * n * 2 / float(np.median(t)), "jnp elementwise"


def copy_ceiling():
    """Bytes read + written per second by a large device-to-device copy; the best of torch's
    copy_ and a jitted jnp copy."""
    out = {}
    n = 2 * 2**30 // 2  # 2 GiB of bf16
    try:
        out["torch_copy"] = torch_copy_bps(gb=2) / 1e12
    except Exception as e:
        out["torch_copy_error"] = repr(e)[:200]
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    ms = time_ms(lambda x: x * 1, x, reps=10, inner=5)
    out["jnp_copy"] = 4 * n / (ms / 1e3) / 1e12
    del x
    out["best"] = max(v for k, v in out.items() if not k.endswith("error"))
    return out


def poison():
    """Fill freed device memory with NaN so that an output element no kernel writes shows."""
    x = jnp.full((512 * 2**20,), jnp.nan, jnp.float32)  # 2 GiB
    x.block_until_ready()
    del x


def rel_err(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
