"""Check every attention kernel against its reference on the GPU and time it against the
baselines, in one run:

    python -m benchmarks.bench_kernels --out DIR [--quick] [--sweep]
                                  [--only prefill,decode,mixed,kv_write]

Prefill: ours vs cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`), JAX's Triton
`pallas.ops.gpu.attention.mha` (K/V repeated to all heads beforehand: it has no GQA), JAX's Mosaic
GPU `attention_mgpu` where it runs, and the jnp reference. Decode: ours vs JAX's
`pallas.ops.gpu.paged_attention` and a jnp decode over a dense cache; KV bytes read per second
against the copy ceiling measured in the same run, and the engine's own ragged call on one
token a sequence with the split heuristic and with the fixed splits of a speculating engine
(`tuning.batch_invariant`, checked against the reference too). Mixed: one ragged call vs the
prefill-chunk and decode calls apart. KV write: the Pallas kernel vs XLA's scatter, in place. Times are
medians over many calls after warm-up of the GPU time of the kernels each call launches, from a
profiler trace with the L2 flushed before each call (`device_ms`). Writes kernels.json and
kernels.md (a table for docs/BENCHMARKS.md) under --out, and a short table last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .attention import (K, LOG, MOSAIC_DECODE, ROOT, cudnn_attention, dense_decode,
                        dense_from_pages, dense_inputs, jax_mgpu_attention, jax_paged_reference,
                        jax_triton_mha, log, paged_inputs, time_mosaic_decode, try_time)
from .common import (DEVICE_KERNELS, FLUSH_MODE, copy_ceiling, poison, rel_err, run_info,
                     time_ms)
from .kernels_sweep import MOSAIC_VARIANTS, sweep
from pallasite.kernels import reference, tuning  # after .attention: it finds them in a checkout

# ---------------------------------------------------------------- cases

def record(kernel, **kw):
    r = dict(kernel=kernel, **run_info(), l2_flush=FLUSH_MODE["mode"])
    tuned = {"flash_attention": "flash", "paged_attention": "decode",
             "ragged_paged_attention": "ragged"}.get(kernel)
    r["params"] = (tuning.params(tuned, kw.get("page_size"), head_dim=kw.get("head_dim"))
                   if tuned else {})
    r.update(kw)
    return r


def bench_prefill(args, records):
    (H, KV), D, dtype = args.heads, args.head_dim, jnp.bfloat16
    B = 4 * 32 // H  # the same query rows a head band at every head count
    seqs = [1024, 4096] if args.quick else [1024, 4096, 16384]
    key = jax.random.PRNGKey(1)
    for S in seqs:
        for causal in (True, False):
            key, sub = jax.random.split(key)
            q, k, v = dense_inputs(sub, B, S, S, H, KV, D, dtype)
            ours = lambda q, k, v: K.flash_attention(q, k, v, causal=causal, impl="pallas")
            triton = lambda q, k, v: K.flash_attention(q, k, v, causal=causal, impl="pallas",
                                                       backend="triton")
            err = None
            poison()
            out = jax.jit(ours)(q, k, v)
            if S <= 4096:  # the fp32 reference needs B*H*S*S*4 bytes of scores
                err = rel_err(out, jax.jit(lambda q, k, v: reference.attention_reference(
                    q, k, v, causal=causal))(q, k, v))
            err_cudnn = rel_err(out, jax.jit(lambda q, k, v: cudnn_attention(q, k, v, causal))(
                q, k, v))
            del out
            flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
            t = {"ours": try_time("ours", ours, q, k, v, device=True)}
            launched = list(DEVICE_KERNELS)
            t["ours_triton"] = try_time("triton", triton, q, k, v, device=True)
            t["cudnn"] = try_time("cudnn", lambda q, k, v: cudnn_attention(q, k, v, causal),
                                  q, k, v, device=True)
            launched_cudnn = list(DEVICE_KERNELS)
            kr, vr = jnp.repeat(k, H // KV, 2), jnp.repeat(v, H // KV, 2)
            t["jax_triton_mha"] = try_time("mha", lambda q, k, v: jax_triton_mha(q, k, v, causal),
                                           q, kr, vr, device=True)
            del kr, vr
            if S == 4096:
                h = [x.astype(jnp.float16) for x in (q, k, v)]  # it takes fp16 only
                t["jax_mgpu_fp16"] = try_time("mgpu", lambda q, k, v: jax_mgpu_attention(
                    q, k, v, causal), *h, device=True)
                t["cudnn_fp16"] = try_time("cudnn16", lambda q, k, v: cudnn_attention(
                    q, k, v, causal), *h, device=True)
                t["ours_fp16"] = try_time("ours16", ours, *h, device=True)
                del h
                t["jnp_reference"] = try_time("ref", lambda q, k, v: reference.attention_reference(
                    q, k, v, causal=causal), q, k, v, reps=5, device=True)
            ours_ms = t.pop("ours")
            base = {n: v for n, v in t.items() if v is not None}
            rec = record("flash_attention", batch=B, seq=S, heads=H, kv_heads=KV, head_dim=D,
                         causal=causal, dtype="bfloat16", ours_ms=ours_ms, baselines=base,
                         rel_err=err, rel_err_vs_cudnn=err_cudnn, timing="device",
                         kernels_launched=launched, kernels_launched_cudnn=launched_cudnn,
                         backend=K.flash_backend(q, k, causal=causal),
                         tflops=flops / (ours_ms / 1e3) / 1e12 if ours_ms else None,
                         ratio_vs_cudnn=(base["cudnn"] / ours_ms) if ours_ms and "cudnn" in base
                         else None)
            records.append(rec)
            log(f"prefill S={S} causal={causal} err={err} err_cudnn={err_cudnn} ours={ours_ms} "
                f"{base}")


def bench_decode(args, records, ceiling):
    H, KV, D, dtype = 32, 8, 128, jnp.bfloat16
    rng = np.random.default_rng(2)
    grid = [(b, c) for b in (1, 8, 64, 256) for c in (1024, 4096, 32768)]
    grid = [(b, c) for b, c in grid if b * c <= 64 * 32768 and not (b == 64 and c == 32768)]
    if args.quick:
        grid = [(1, 32768), (64, 4096)]
    for page_size in args.page_sizes:
        for B, C in (grid if page_size == 16 else [(1, 32768), (64, 4096)]):
            q, kp, vp, _, ctx, table = paged_inputs(rng, [1] * B, [C] * B, H, KV, D, page_size,
                                                   dtype)
            q = q.reshape(B, H, D)
            ours = lambda q, kp, vp, ctx, table: K.paged_attention(q, kp, vp, ctx, table,
                                                                   impl="pallas")
            err = None
            if B * C <= 64 * 4096:
                poison()
                err = rel_err(jax.jit(ours)(q, kp, vp, ctx, table),
                              jax.jit(reference.paged_attention_reference)(q, kp, vp, ctx, table))
            t = {"ours": try_time("ours", ours, q, kp, vp, ctx, table, device=True)}
            launched = list(DEVICE_KERNELS)
            t["jax_pallas_paged"] = try_time("jax paged", jax_paged_reference, q, kp, vp, ctx,
                                             table, device=True)
            loop = {"ours": try_time("ours", ours, q, kp, vp, ctx, table, loop=True),
                    "jax_pallas_paged": try_time("jax paged", jax_paged_reference, q, kp, vp,
                                                 ctx, table, loop=True)}
            # The engine's own path (ragged, one token a sequence), with the split heuristic and
            # with the fixed splits a speculating engine traces under (`batch_invariant`).
            qs = jnp.arange(B + 1, dtype=jnp.int32)
            ragged = lambda q, kp, vp, ctx, table: K.ragged_paged_attention(
                q, kp, vp, qs, ctx, table, impl="pallas")
            t["ours_ragged"] = try_time("ragged", ragged, q, kp, vp, ctx, table, device=True)
            err_invariant = None
            with tuning.batch_invariant():
                if err is not None:
                    poison()
                    err_invariant = rel_err(jax.jit(ragged)(q, kp, vp, ctx, table), jax.jit(
                        reference.paged_attention_reference)(q, kp, vp, ctx, table))
                t["ours_ragged_invariant"] = try_time("invariant", ragged, q, kp, vp, ctx, table,
                                                      device=True)
            backend = K.decode_backend(q, kp, table)
            if backend != "triton":  # PALLASITE_DECODE_BACKEND asked for another
                t["ours_triton"] = try_time("triton", lambda *a: K.paged_attention(
                    *a, impl="pallas", backend="triton"), q, kp, vp, ctx, table, device=True)
            if MOSAIC_DECODE["ok"]:
                t["ours_mosaic"], err_mosaic = time_mosaic_decode(q, kp, vp, ctx, table,
                                                                  check=err is not None)
            kd, vd = dense_from_pages(kp, table), dense_from_pages(vp, table)
            t["jnp_dense"] = try_time("dense", lambda q, k, v, c: dense_decode(q, k, v, c),
                                      q, kd, vd, ctx, device=True)
            del kd, vd
            kv_bytes = 2 * B * C * KV * D * 2
            ours_ms = t.pop("ours")
            base = {n: v for n, v in t.items() if v is not None}
            tbps = kv_bytes / (ours_ms / 1e3) / 1e12 if ours_ms else None
            if MOSAIC_DECODE["ok"]:
                log(f"  mosaic decode rel err {err_mosaic}")
            rec = record("paged_attention", batch=B, context=C, page_size=page_size, heads=H,
                         backend=backend,
                         kv_heads=KV, head_dim=D, causal=True, dtype="bfloat16", ours_ms=ours_ms,
                         baselines=base, rel_err=err, tbps=tbps, timing="device",
                         kernels_launched=launched, fori_loop_ms=loop,
                         rel_err_mosaic=err_mosaic if MOSAIC_DECODE["ok"] else None,
                         rel_err_invariant=err_invariant,
                         frac_of_copy_bw=tbps / ceiling if tbps else None,
                         speedup_vs_jax_paged=(base["jax_pallas_paged"] / ours_ms)
                         if ours_ms and "jax_pallas_paged" in base else None,
                         num_splits=tuning.num_splits(B * KV, -(-(C // page_size) // tuning.params(
                             "decode", page_size)["pages_per_block"])))
            records.append(rec)
            log(f"decode ps={page_size} B={B} C={C} err={err} ours={ours_ms} {base} "
                f"tbps={tbps}")
            del q, kp, vp


def bench_kv_write(args, records, ceiling):
    """A step's K/V rows into their pages, in place (pages donated, each call's output the next
    call's input): the Pallas kernel (`kernels/kv_write.py`, one launch) vs XLA's scatter."""
    from pallasite.kernels import kv_write
    KV, D, page_size, P, dtype = 8, 128, 16, 8192, jnp.bfloat16
    rng = np.random.default_rng(4)
    fns = {"pallas": lambda pg, k, v, s: kv_write.write_kv(*pg, k, v, s),
           "xla_scatter": lambda pg, k, v, s: reference.write_kv_reference(*pg, k, v, s)}
    for T in (1, 64, 512, 2048):
        pages = lambda: tuple(jnp.asarray(rng.standard_normal((KV, P, page_size, D)), dtype)
                              for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((T, KV, D)), dtype) for _ in range(2))
        slots = jnp.asarray(rng.permutation(P * page_size)[:T], jnp.int32)
        slots = slots.at[T // 2].set(-1) if T > 1 else slots  # a padding token
        pg = pages()
        outs = {n: jax.jit(f)(pg, k, v, slots) for n, f in fns.items()}
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs["pallas"],
                                                                outs["xla_scatter"]))
        del outs, pg
        t, launched = {}, {}
        for n, f in fns.items():
            t[n] = try_time(n, f, pages(), k, v, slots, device=True, chain=True)
            launched[n] = list(DEVICE_KERNELS)
        records.append(record("kv_write", batch=T, kv_heads=KV, head_dim=D, page_size=page_size,
                              dtype="bfloat16", ours_ms=t["pallas"],
                              baselines={"xla_scatter": t["xla_scatter"]}, same_as_xla=same,
                              timing="device", kernels_launched=launched["pallas"],
                              kernels_launched_xla=launched["xla_scatter"]))
        log(f"kv_write T={T} same={same} {t} {launched}")


def bench_mixed(args, records, ceiling):
    H, KV, D, dtype = 32, 8, 128, jnp.bfloat16
    rng = np.random.default_rng(3)
    page_size = 16
    dec_ctx = rng.integers(512, 4096, 63)
    q_lens = [512] + [1] * 63
    ctx = [2048] + list(dec_ctx)
    q, kp, vp, qs, ctx, table = paged_inputs(rng, q_lens, ctx, H, KV, D, page_size, dtype)

    def ragged(q, kp, vp, qs, ctx, table, **kw):
        return K.ragged_paged_attention(q, kp, vp, qs, ctx, table, impl="pallas", **kw)

    def apart(q, kp, vp, qs, ctx, table):
        a = K.ragged_paged_attention(q[:512], kp, vp, qs[:2], ctx[:1], table[:1], impl="pallas")
        b = K.paged_attention(q[512:], kp, vp, ctx[1:], table[1:], impl="pallas")
        return jnp.concatenate([a, b])

    poison()
    ref = jax.jit(reference.ragged_paged_attention_reference)(q, kp, vp, qs, ctx, table)
    err = rel_err(jax.jit(ragged)(q, kp, vp, qs, ctx, table), ref)
    err_apart = rel_err(jax.jit(apart)(q, kp, vp, qs, ctx, table), ref)
    # 13 padding tokens past query_start[-1], as a bucketed step has: their rows must come back
    # zeros, written by the kernel in 1 split and by the merge in more.
    n_pad = 13
    q_pad = jnp.concatenate([q, jax.random.normal(jax.random.PRNGKey(5), (n_pad, H, D), dtype)])
    ref_pad = jnp.concatenate([ref, jnp.zeros((n_pad, H, D), ref.dtype)])
    padded = {}
    for name, kw in (("default", {}), ("splits_1", dict(num_splits=1))):
        poison()
        out = jax.jit(lambda *a, kw=kw: ragged(*a, **kw))(q_pad, kp, vp, qs, ctx, table)
        padded[name] = dict(rel_err=rel_err(out, ref_pad),
                            padding_zero=bool(np.all(np.asarray(out[-n_pad:]) == 0)))
    ours_ms = time_ms(ragged, q, kp, vp, qs, ctx, table, device=True)
    launched = list(DEVICE_KERNELS)
    base = {"separate_prefill_plus_decode": time_ms(apart, q, kp, vp, qs, ctx, table,
                                                    device=True)}
    loop = {"ours": try_time("ours", ragged, q, kp, vp, qs, ctx, table, loop=True),
            "separate_prefill_plus_decode": try_time("apart", apart, q, kp, vp, qs, ctx, table,
                                                     loop=True)}
    variants = dict(block_rows_16=dict(block_rows=16), block_rows_32=dict(block_rows=32),
                    splits_1=dict(num_splits=1), splits_4=dict(num_splits=4))
    for name, kw in variants.items():
        base[f"ours_{name}"] = try_time("variant", lambda *a, kw=kw: ragged(*a, **kw), q, kp, vp,
                                        qs, ctx, table, device=True)
    base["jnp_reference"] = try_time("ref", reference.ragged_paged_attention_reference,
                                     q, kp, vp, qs, ctx, table, reps=5, device=True)
    base = {n: v for n, v in base.items() if v is not None}
    kv_bytes = 2 * int(np.asarray(ctx).sum()) * KV * D * 2
    tbps = kv_bytes / (ours_ms / 1e3) / 1e12
    rec = record("ragged_paged_attention", batch=64, context=int(np.asarray(ctx).max()),
                 seq=512, page_size=page_size, causal=True, dtype="bfloat16", ours_ms=ours_ms,
                 baselines=base, rel_err=err, rel_err_separate=err_apart, tbps=tbps,
                 padded_check=padded,
                 timing="device", kernels_launched=launched, fori_loop_ms=loop,
                 frac_of_copy_bw=tbps / ceiling,
                 note="one 512-token chunk (context 2048) + 63 decode tokens (context 512..4095)")
    records.append(rec)
    log(f"mixed err={err} err_apart={err_apart} padded={padded} ours={ours_ms} {base}")


# Prefixed with `overlap = True` or `False`: the pipelined-consumer variant is smoke-tested on
# its own, so that a failure there only drops it from the sweep.
FLASH_SMOKE = """
import jax, jax.numpy as jnp
from pallasite.kernels import flash_attention, reference
ks = jax.random.split(jax.random.PRNGKey(0), 3)
q, k, v = (jax.random.normal(x, (1, 256, 4, 128), jnp.bfloat16) for x in ks)
k, v = k[:, :, :2], v[:, :, :2]
for c, n in ((True, None), (False, None), (True, 3), (False, 3)):
    o = flash_attention(q, k, v, causal=c, impl="pallas", backend="mosaic", num_ctas=n,
                        overlap=overlap)
    r = reference.attention_reference(q, k, v, causal=c)
    e = float(jnp.linalg.norm((o - r).astype(float)) / jnp.linalg.norm(r.astype(float)))
    print("mosaic smoke flash causal", c, "ctas", n, "overlap", overlap, "rel err", e,
          flush=True)
    assert e < 2e-2, e
"""

PAGED_SMOKE = """
import jax, jax.numpy as jnp, numpy as np
from pallasite.kernels import paged_mgpu, reference
rng = np.random.default_rng(0)
S, H, KV, D, ps, pps = 3, 32, 8, 128, 16, 40
ctx = jnp.asarray([1, 333, 640], jnp.int32)
table = jnp.asarray(rng.permutation(S * pps + 5)[:S * pps].reshape(S, pps), jnp.int32)
q = jnp.asarray(rng.standard_normal((S, H, D)), jnp.bfloat16)
kp, vp = (jnp.asarray(rng.standard_normal((KV, S * pps + 5, ps, D)), jnp.bfloat16)
          for _ in range(2))
r = reference.paged_attention_reference(q, kp, vp, ctx, table)
for splits, stages in ((1, 4), (4, 2), (16, 3)):
    o = paged_mgpu.paged_attention(q, kp, vp, ctx, table, num_splits=splits,
                                   num_stages=stages)
    e = float(jnp.linalg.norm((o - r).astype(float)) / jnp.linalg.norm(r.astype(float)))
    print("mosaic smoke paged splits", splits, "stages", stages, "rel err", e, flush=True)
    assert e < 2e-2, e
"""


def mosaic_smoke(code, timeout=150):
    """Run a Mosaic GPU kernel once in a child process: a kernel that hangs or fails to build
    then costs a few minutes, not the run. Returns (ok, its verdict lines)."""
    import subprocess
    # The parent already holds most of the GPU's memory: the child allocates as it goes.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT, env=env)
        said = [ln for ln in (p.stdout + p.stderr).splitlines()
                if "mosaic smoke" in ln or "Error" in ln or "error" in ln.split(":")[0]]
        return p.returncode == 0, "\n".join(said)[-3000:]
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout}s"


# ---------------------------------------------------------------- report

def table(records, ceiling):
    from .fa3 import fa3_table
    fa3_rows = [r for r in records if r.get("part") == "fa3"]
    records = [r for r in records if r.get("part") != "fa3"]
    if fa3_rows and not records:
        return fa3_table(fa3_rows)
    r0 = records[0] if records else run_info()
    lines = [f"GPU: {r0['gpu']}; JAX {r0['jax_version']}; {r0.get('date', '')}; "
             f"copy ceiling {ceiling:.2f} TB/s (read + written)", ""]
    lines += ["| prefill (B=4, 32/8 heads, d=128, bf16) | ours ms | TFLOP/s | cuDNN ms | "
              "vs cuDNN | ours Triton ms | JAX mha ms | ours fp16 ms | JAX mgpu fp16 ms | "
              "cuDNN fp16 ms | jnp ms | rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, p=3: "-" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))
    for r in records:
        if r["kernel"] == "flash_attention":
            b = r["baselines"]
            lines.append(f"| S={r['seq']} {'causal' if r['causal'] else 'full'} | "
                         f"{f(r['ours_ms'])} | {f(r['tflops'], 0)} | {f(b.get('cudnn'))} | "
                         f"{f(r['ratio_vs_cudnn'], 2)}x | {f(b.get('ours_triton'))} | "
                         f"{f(b.get('jax_triton_mha'))} | {f(b.get('ours_fp16'))} | "
                         f"{f(b.get('jax_mgpu_fp16'))} | {f(b.get('cudnn_fp16'))} | "
                         f"{f(b.get('jnp_reference'))} | "
                         f"{f(r['rel_err'] or r.get('rel_err_vs_cudnn'), 4)} |")
    lines += ["", "| decode (32/8 heads, d=128, bf16) | ours | ms | TB/s | of copy | "
              "JAX paged ms | vs JAX | jnp dense ms | ours Triton ms | ours Mosaic ms | "
              "ragged ms | ragged, invariant splits ms | rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["kernel"] == "paged_attention":
            b = r["baselines"]
            lines.append(f"| B={r['batch']} ctx={r['context']} page={r['page_size']} | "
                         f"{r.get('backend', 'triton')} | {f(r['ours_ms'], 4)} | "
                         f"{f(r['tbps'], 2)} | "
                         f"{f(r['frac_of_copy_bw'] and 100 * r['frac_of_copy_bw'], 0)}% | "
                         f"{f(b.get('jax_pallas_paged'), 4)} | "
                         f"{f(r['speedup_vs_jax_paged'], 2)}"
                         f"{'x' if r['speedup_vs_jax_paged'] else ''} | "
                         f"{f(b.get('jnp_dense'), 4)} | "
                         f"{f(b.get('ours_triton'), 4)} | {f(b.get('ours_mosaic'), 4)} | "
                         f"{f(b.get('ours_ragged'), 4)} | {f(b.get('ours_ragged_invariant'), 4)} | "
                         f"{f(r['rel_err'], 4)} |")
    kv = [r for r in records if r["kernel"] == "kv_write"]
    if kv:
        lines += ["", "| KV write (8 kv heads, d=128, page 16, bf16) | Pallas ms | XLA scatter ms "
                  "| same result |", "|---|---|---|---|"]
        lines += [f"| T={r['batch']} tokens | {f(r['ours_ms'], 4)} | "
                  f"{f(r['baselines'].get('xla_scatter'), 4)} | {r['same_as_xla']} |" for r in kv]
    for r in records:
        if r["kernel"] == "ragged_paged_attention":
            b = r["baselines"]
            lines += ["", f"mixed ({r['note']}): one ragged call {f(r['ours_ms'], 4)} ms vs "
                      f"separate {f(b.get('separate_prefill_plus_decode'), 4)} ms; "
                      + ", ".join(f"{n} {f(v, 4)} ms" for n, v in b.items()
                                  if n != "separate_prefill_plus_decode")
                      + f"; rel err {f(r['rel_err'], 4)}"]
    if fa3_rows:
        lines += ["", fa3_table(fa3_rows)]
    return "\n".join(lines)


def render(paths, out):
    """Merge kernels.json records from several runs into one table."""
    merged = {}
    for p in paths:
        for r in json.loads(Path(p).read_text()):
            key = tuple(r.get(k) for k in ("kernel", "batch", "seq", "context", "page_size",
                                           "causal"))
            merged[key] = r
    records = list(merged.values())
    ceiling = next(r["tbps"] / r["frac_of_copy_bw"] for r in records if r.get("frac_of_copy_bw"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(records, indent=1) + "\n")
    md = table(records, ceiling)
    (out / "kernels.md").write_text(md + "\n")
    print(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--heads", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 8),
                    help="prefill: query heads and kv heads (Gemma-3-4B: 8,4)")
    ap.add_argument("--head-dim", type=int, default=128, help="prefill: head dim (Gemma: 256)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-parts", default="flash,decode",
                    help="what --sweep tunes: flash (Triton and Mosaic), mosaic, decode")
    ap.add_argument("--only", default="prefill,decode,mixed,kv_write",
                    help="parts to run; `fa3` times FlashAttention-3 (flash-attn3-jax) beside ours")
    ap.add_argument("--fa3-parts", default="mixed,decode,prefill",
                    help="with --only fa3: which of its parts run")
    ap.add_argument("--page-sizes", default="16")
    ap.add_argument("--flush", choices=("write", "read"), default="read",
                    help="how the L2 is emptied before each timed call (see common.l2_flush)")
    ap.add_argument("--render", nargs="+", metavar="JSON",
                    help="no GPU work: merge these kernels.json files (later ones win for the "
                         "same case) into --out/kernels.json and kernels.md")
    args = ap.parse_args()
    if args.render:
        return render(args.render, Path(args.out))
    args.page_sizes = [int(x) for x in args.page_sizes.split(",")]
    FLUSH_MODE["mode"] = args.flush
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"jax {jax.__version__} devices {jax.devices()} tuning key {tuning.gpu_key()}")
    flash = "prefill" in args.only or args.sweep
    if K.flash_backend(jnp.zeros((1, 256, 4, 128), jnp.bfloat16),
                       jnp.zeros((1, 256, 2, 128), jnp.bfloat16)) == "mosaic":
        ok, said = mosaic_smoke("overlap = False\n" + FLASH_SMOKE) if flash else (True, "")
        log(said)
        if not ok:  # everything below then runs the Triton kernel
            log("Mosaic GPU flash kernel FAILED its smoke test: prefill falls back to Triton")
            os.environ["PALLASITE_FLASH_BACKEND"] = "triton"
        ok, said = mosaic_smoke("overlap = True\n" + FLASH_SMOKE) if flash else (True, "")
        log(said)
        if not ok:
            log("Mosaic GPU flash overlap=True FAILED its smoke test: not swept")
            MOSAIC_VARIANTS[:] = [v for v in MOSAIC_VARIANTS if not v.get("overlap")]
        ok, said = mosaic_smoke(PAGED_SMOKE)
        log(said)
        MOSAIC_DECODE["ok"] = ok
        if not ok:
            log("Mosaic GPU paged decode kernel FAILED its smoke test: not timed")
    ceil = copy_ceiling()
    log(f"copy ceiling {ceil}")
    records, sweeps = [], []
    if args.sweep:
        try:
            sweeps = sweep(args)
        except Exception:
            log(traceback.format_exc())
    parts = args.only.split(",")
    from .fa3 import bench_fa3
    for name, fn in (("mixed", bench_mixed), ("decode", bench_decode),
                     ("kv_write", bench_kv_write), ("prefill", bench_prefill), ("fa3", bench_fa3)):
        if name in parts:
            t0 = time.time()
            try:
                if name == "fa3":
                    fn(args, records, ceil["best"], record)
                else:
                    fn(args, records, ceil["best"]) if name != "prefill" else fn(args, records)
            except Exception:
                log(traceback.format_exc())
            log(f"[{name} took {time.time() - t0:.0f}s]")
            (out / "kernels.json").write_text(json.dumps(records, indent=1))
    (out / "kernels.json").write_text(json.dumps(records, indent=1))
    (out / "sweep.json").write_text(json.dumps(dict(copy=ceil, sweep=sweeps,
                                                   table=tuning.TABLE), indent=1))
    md = table(records, ceil["best"])
    (out / "kernels.md").write_text(md + "\n")
    (out / "log.txt").write_text("\n".join(LOG) + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
