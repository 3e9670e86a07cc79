"""FP8 weights against bf16 on the GPU, all timed in one run (Llama-3-8B shapes, random weights).

    python -m benchmarks.bench_quant --out DIR          # H100: about 4 minutes
    python -m benchmarks.bench_quant --out DIR --tiny   # CPU dry run of every part
    python -m benchmarks.bench_quant --out DIR --parts prefill_matmul,prefill --w8a8 xla,pallas

FP8 weights are stored [N, K], as the library stores them (model/quant.py `k_last`).

1. `matmul`: the W8A16 Pallas kernel vs the bf16 product (jnp) at the 8B layer shapes for
   M = 1..16 rows, each checked first against its jnp reference on fresh inputs (freed memory
   poisoned); kernel time from a profiler trace with the L2 flushed (benchmarks/common.py), and
   the fraction of the copy bandwidth in FP8 bytes; XLA's dequantize-then-dot beside it.
2. `prefill_matmul`: W8A8 (XLA's FP8 dot or, with --w8a8, each kernel named; per-token
   activation scales included) vs the bf16 product and W8A16 at M = 2048.
3. `prefill`: a 2048-token prompt through the whole model (`forward_logits`), FP8 weights
   (the W8A8 path) vs bf16, tokens/s.
3b. `w8a8_prefill`: INT8 W8A8 (SmoothQuant's product: per-token INT8 activations, XLA's INT8
   dot) against bf16: each fused layer product at M = 4096 (with and without the activations'
   quantization and the scaling), then a 4096-token prompt through the whole model.
4. `batch1`: batch-1 decode through `LLM.stream`, FP8 weights vs bf16: median time per token,
   and the FP8 roofline (bytes of FP8 weights and scales, the bf16 LM head and norms, and the KV
   read, at the measured copy bandwidth; the embedding table is gathered, not read). With
   `--batch1-variants`, each weight kind also with its q/k/v and gate/up kept apart (the
   engine fuses them on one device, `model/fuse.py`) and with a lone decode row padded to two.

Records (gpu, date, jax_version, mode, speedup_vs_bf16, ...) go to OUT/quant.json, a table to
stdout and OUT/quant.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common

SHAPES = {"wq": (4096, 4096), "wk/wv": (4096, 1024), "w_gate/w_up": (4096, 14336),
          "w_down": (14336, 4096)}
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)


def kernel_s(fn, *args):
    """Seconds one call's kernels take on the GPU (profiler trace, L2 flushed first); on CPU
    (--tiny) the host wall clock."""
    if jax.default_backend() == "gpu":
        return common.device_ms(fn, *args) / 1e3
    return common.host_ms(jax.jit(fn), *args, reps=5) / 1e3


def median_s(fn, *args, reps=10):
    return common.host_ms(fn, *args, reps=reps) / 1e3


def engine_s(fn, params, ids, reps=10):
    """Seconds of one call of fn compiled with the options the engine compiles a step of its
    tokens with: on the GPU its kernels' summed device time (median, `common.device_ms`; the
    host clock moved a bf16 prefill by 9% between runs of one call), elsewhere the host's."""
    from pallasite.serving.settings import compiler_options
    exe = jax.jit(fn).lower(params, ids).compile(compiler_options(ids.size))
    if jax.default_backend() == "gpu":
        return common.device_ms(exe, params, ids, reps=reps, compiled=True) / 1e3
    return median_s(exe, params, ids, reps=5)


def fp8_matrix(key, k, n):
    from pallasite.kernels.quant_reference import FP8_MAX
    w = jax.random.normal(key, (k, n), jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / FP8_MAX
    return (w / scale).astype(jnp.float8_e4m3fn), scale, w.astype(jnp.bfloat16)


# -- 1, 2: the products -------------------------------------------------------------------------
def bench_matmuls(rows, bw, tiny, mode):
    from pallasite import kernels
    from pallasite.kernels import quant_reference as qr
    records = []
    shapes = {"small": (256, 512)} if tiny else SHAPES
    path = "w8a16" if mode == "decode" else "w8a8"
    for name, (k, n) in shapes.items():
        key = jax.random.key(k + n)
        q, scale, w = fp8_matrix(key, k, n)
        q_nk = jnp.asarray(q.T, copy=True)  # stored [N, K], as the library stores FP8 weights
        for m in rows:
            fp8 = lambda x, q, s: kernels.quant_matmul(x, q, s, mode=path, layout="nk")
            # Checked first on fresh inputs, freed memory poisoned: against the same math.
            if jax.default_backend() == "gpu":
                common.poison()
            x2 = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            got = jax.jit(fp8)(x2, q_nk, scale)
            ref = (qr.w8a16_reference if path == "w8a16" else qr.w8a8_reference)(x2, q, scale)
            err = common.rel_err(got, ref)
            assert err <= 1e-3, f"{name} M={m} {path}: relative error {err:.2e} > 1e-3"
            x = jax.random.normal(jax.random.fold_in(key, m + 1), (m, k), jnp.bfloat16)
            t_fp8 = kernel_s(fp8, x, q_nk, scale)
            t_bf16 = kernel_s(lambda x, w: x @ w, x, w)
            rec = dict(mode="matmul" if mode == "decode" else "prefill_matmul", shape=name,
                       m=m, k=k, n=n, path=path, fp8_us=1e6 * t_fp8, bf16_us=1e6 * t_bf16,
                       speedup_vs_bf16=t_bf16 / t_fp8, rel_err=err)
            if mode == "decode":
                rec["frac_of_copy_bw"] = (k * n + 4 * n + 2 * m * (k + n)) / t_fp8 / bw
                rec["xla_w8a16_us"] = 1e6 * kernel_s(qr.w8a16_reference, x, q, scale)
            else:
                flops = 2 * m * k * n
                rec["fp8_tflops"], rec["bf16_tflops"] = flops / t_fp8 / 1e12, flops / t_bf16 / 1e12
                rec["w8a16_us"] = 1e6 * kernel_s(lambda x, q, s: kernels.quant_matmul(
                    x, q, s, mode="w8a16", layout="nk"), x, q_nk, scale)
            records.append(rec)
            print(f"  {rec['mode']:14s} {name:12s} M={m:5d}  fp8 {rec['fp8_us']:8.1f} us  "
                  f"bf16 {rec['bf16_us']:8.1f} us  x{rec['speedup_vs_bf16']:.2f}", flush=True)
    return records


# -- 3: prefill through the model ---------------------------------------------------------------
def bench_prefill(config, params, qparams, tokens):
    """Both with q/k/v and gate/up fused, as the engine holds them on one device."""
    from pallasite.model import forward_logits
    from pallasite.model.fuse import fuse_params
    ids = jax.random.randint(jax.random.key(1), (1, tokens), 0, config.vocab_size)
    f = jax.jit(lambda p, ids: forward_logits(p, config, ids)[:, -1])
    copy = lambda p: jax.tree.map(lambda a: a, p, is_leaf=quant_like)
    t_bf16 = engine_s(f, fuse_params(copy(params)), ids)
    t_fp8 = engine_s(f, fuse_params(copy(qparams)), ids)
    return dict(mode="prefill", tokens=tokens, bf16_tok_per_s=tokens / t_bf16,
                fp8_tok_per_s=tokens / t_fp8, speedup_vs_bf16=t_bf16 / t_fp8)


FUSED = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
         "down": (14336, 4096)}


def bench_int8(config, params, tokens, products=True):
    """INT8 W8A8 products (unless not `products`) and prefill against bf16 (weights int8 per
    channel, stored [N, K])."""
    from pallasite.kernels import quant_reference as qr
    from pallasite.model import forward_logits, quant
    from pallasite.model.fuse import fuse_params
    records, m = [], tokens
    for name, (k, n) in FUSED.items() if config.hidden_size == 4096 and products else ():
        kx, kw = jax.random.split(jax.random.key(k + n))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.bfloat16)
        qa = quant.matrix(quant.quantize_linear(w, (0, 1), "int8"))  # [N, K]
        xq, xs = qr.quantize_rows_int8(x)
        dot = lambda xq, q: jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.int32)
        t_bf16 = kernel_s(lambda x, w: x @ w, x, w)
        t_int8 = kernel_s(lambda x, q, s: qr.w8a8_int8_matmul(x, q, s, layout="nk"),
                          x, qa.q, qa.scale.T)
        t_dot = kernel_s(dot, xq, qa.q)
        records.append(dict(mode="w8a8_matmul", shape=name, m=m, bf16_us=1e6 * t_bf16,
                            int8_us=1e6 * t_int8, int8_dot_us=1e6 * t_dot,
                            speedup_vs_bf16=t_bf16 / t_int8, dot_speedup_vs_bf16=t_bf16 / t_dot,
                            int8_dot_tops=2 * m * k * n / t_dot / 1e12))
        print(f"  w8a8 {name}: {records[-1]}", flush=True)
    ids = jax.random.randint(jax.random.key(1), (1, tokens), 0, config.vocab_size)
    f = jax.jit(lambda p, ids: forward_logits(p, config, ids)[:, -1])
    copy = lambda p: jax.tree.map(lambda a: a, p, is_leaf=quant_like)
    t_bf16 = engine_s(f, fuse_params(copy(params)), ids)
    t_int8 = engine_s(f, fuse_params(quant.quantize_params(params, "int8")), ids)
    records.append(dict(mode="w8a8_prefill", tokens=tokens, bf16_tok_per_s=tokens / t_bf16,
                        int8_tok_per_s=tokens / t_int8, speedup_vs_bf16=t_bf16 / t_int8))
    print(f"  w8a8 prefill: {records[-1]}", flush=True)
    return records


def quant_like(a):
    from pallasite.model import quant
    return quant.is_quantized(a) or quant.is_packed(a)


# -- 4: batch-1 decode through LLM.stream ---------------------------------------------------------
def stream_ms_per_token(config, params, prompt_len, new_tokens, fused=True, rows=1):
    """Median ms a decode token through `LLM.stream`; `fused` False keeps q/k/v and gate/up
    apart, `rows` is the smallest token bucket (the engine raises 1 to 2 for bf16)."""
    from pallasite.serving import replicas
    from pallasite.serving.llm import LLM, SamplingParams
    pages = -(-(prompt_len + new_tokens) // 16)
    params = jax.tree.map(lambda a: a, params, is_leaf=quant_like)
    fuse = replicas.fuse_params
    if not fused:  # the engine fuses on one device; this variant measures what that buys
        replicas.fuse_params = lambda p: p
    try:
        llm = LLM.from_params(config, params, None, max_num_seqs=1,
                              max_num_batched_tokens=prompt_len, num_pages=pages + 8,
                              token_buckets=[rows, prompt_len], page_buckets=[pages],
                              max_model_len=prompt_len + new_tokens)
    finally:
        replicas.fuse_params = fuse
    del params
    try:
        prompt = np.random.default_rng(0).integers(0, config.vocab_size, prompt_len).tolist()
        sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(2):  # the first run warms anything left cold
            stamps = []
            for _ in llm.stream(prompt, sampling):
                stamps.append(time.perf_counter())
        gaps = np.diff(stamps[1:])  # decode tokens only
        return 1e3 * float(np.median(gaps))
    finally:
        llm.close()


def decode_bytes(config, params, context):
    from pallasite.model import quant
    weights = quant.weight_bytes(params) - params["embed"].nbytes
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * context
    return weights + kv


def fusions(args):
    """Each --glu and --norm value in turn, set in the environment (traced anew each time):
    yields the record's tags."""
    for glu in args.glu.split(","):
        for norm in args.norm.split(","):
            os.environ["PALLASITE_W8A8_GLU"] = "0" if glu == "off" else "1"
            os.environ["PALLASITE_W8A8_NORM"] = "0" if norm == "off" else "1"
            yield dict(glu_fused=glu != "off", norm_fused=norm != "off")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU dry run)")
    p.add_argument("--parts", default="matmul,prefill_matmul,prefill,batch1")
    p.add_argument("--w8a8", default=None,
                   help="comma-separated W8A8 kernels (kernels.W8A8_IMPLS: xla, pallas) to run "
                        "the prefill parts with, one after another; default: the routing's own")
    p.add_argument("--glu", default="on",
                   help="on,off: the prefill parts with SwiGLU fused between the W8A8 products "
                        "(`kernels.w8a8_glu`) and without (PALLASITE_W8A8_GLU=0), in that order")
    p.add_argument("--norm", default="on",
                   help="on,off: the prefill parts with the norms quantizing the products' "
                        "input rows in their pass (`kernels.norm_quantize`) and without "
                        "(PALLASITE_W8A8_NORM=0), in that order, within each --glu value")
    p.add_argument("--batch1-variants", default="bf16:fused:2,fp8:fused:1",
                   help="weights:layout:rows, comma-separated, the bf16 baseline first and the "
                        "FP8 figure last (layout fused or apart; rows the smallest bucket)")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    tiny = args.tiny
    from pallasite import kernels
    from pallasite.model import config_from_dict, init_params, quant
    bw, how = common.copy_bandwidth(gb=0.05 if tiny else 4)
    gpu = common.run_info()["gpu"]
    print(f"{gpu}, jax {jax.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s ({how}), "
          f"FP8 tensor cores: {kernels.has_fp8_tensor_cores()}", flush=True)
    records = []
    t0 = time.time()
    if "matmul" in parts:
        records += bench_matmuls([1, 2, 4, 8, 16], bw, tiny, "decode")
    impls = args.w8a8.split(",") if args.w8a8 else [None]
    config = config_from_dict(TINY if tiny else LLAMA3_8B)
    if parts & {"prefill", "batch1", "w8a8_prefill"}:
        params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()  # made on the device
        qparams = quant.quantize_params(params)
    before = os.environ.get("PALLASITE_W8A8_IMPL")
    for impl in impls:  # each traced anew, so the variable reaches quant_matmul
        if impl is not None:
            os.environ["PALLASITE_W8A8_IMPL"] = impl
        tag = lambda recs: [r | dict(w8a8_impl=impl or before or "xla") for r in recs]
        if "prefill_matmul" in parts:
            records += tag(bench_matmuls([64 if tiny else 2048], bw, tiny, "prefill"))
        for fused in fusions(args) if "prefill" in parts else ():
            records += tag([bench_prefill(config, params, qparams, 64 if tiny else 2048)
                            | fused])
            print(f"  prefill: {records[-1]}", flush=True)
    for i, fused in enumerate(fusions(args) if "w8a8_prefill" in parts else ()):
        records += [r | fused
                    for r in bench_int8(config, params, 64 if tiny else 4096, products=i == 0)]
    for name in ("PALLASITE_W8A8_GLU", "PALLASITE_W8A8_NORM"):
        os.environ.pop(name, None)
    if before is None:
        os.environ.pop("PALLASITE_W8A8_IMPL", None)
    else:
        os.environ["PALLASITE_W8A8_IMPL"] = before
    if "batch1" in parts:
        prompt_len, new = (16, 16) if tiny else (128, 128)
        context = prompt_len + new // 2
        fp8_bytes, bf16_bytes = decode_bytes(config, qparams, context), \
            decode_bytes(config, params, context)
        roof_ms = 1e3 * fp8_bytes / bw
        variants = args.batch1_variants.split(",")
        ms = {}
        for v in variants:  # bf16 ones first: its weights are freed before FP8's run
            kind, layout, rows = v.split(":")
            ms[v] = stream_ms_per_token(config, params if kind == "bf16" else qparams,
                                        prompt_len, new, fused=layout == "fused", rows=int(rows))
            print(f"  batch1 {v}: {ms[v]:.3f} ms", flush=True)
            if not any(w.startswith("bf16") for w in variants[variants.index(v) + 1:]):
                params = None
        bf16_ms, fp8_ms = ms[variants[0]], ms[variants[-1]]
        records.append(dict(mode="batch1", batch=1, context=context, bf16_ms=bf16_ms,
                            fp8_ms=fp8_ms, speedup_vs_bf16=bf16_ms / fp8_ms,
                            fp8_roofline_ms=roof_ms, frac_of_fp8_roofline=roof_ms / fp8_ms,
                            bf16_roofline_ms=1e3 * bf16_bytes / bw, fp8_bytes=fp8_bytes,
                            bf16_bytes=bf16_bytes, bf16_variant=variants[0],
                            fp8_variant=variants[-1], variants_ms=ms))
        print(f"  batch1: {records[-1]}", flush=True)
    head = common.run_info() | dict(copy_bw_tbps=bw / 1e12, copy_bw_by=how, tiny=tiny)
    records = [head | r for r in records]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.json").write_text(json.dumps(records, indent=1))
    lines = ["| mode | shape | M | fp8 | bf16 | speedup_vs_bf16 | note |", "|---|---|---|---|---|---|---|"]
    glu_note = lambda r: {True: ", SwiGLU between the GEMMs", False: ", SwiGLU by XLA"}.get(
        r.get("glu_fused"), "") + {True: ", norms quantize", False: ", norms by XLA"}.get(
        r.get("norm_fused"), "")
    for r in records:
        if r["mode"] in ("matmul", "prefill_matmul"):
            note = (f"{r['frac_of_copy_bw']:.0%} of copy bw; XLA W8A16 {r['xla_w8a16_us']:.1f} us"
                    if r["mode"] == "matmul" else
                    f"{r['w8a8_impl']}: {r['fp8_tflops']:.0f} vs {r['bf16_tflops']:.0f} "
                    f"TFLOP/s; W8A16 {r['w8a16_us']:.0f} us")
            lines.append(f"| {r['mode']} | {r['shape']} | {r['m']} | {r['fp8_us']:.1f} us | "
                         f"{r['bf16_us']:.1f} us | {r['speedup_vs_bf16']:.2f} | {note} |")
        elif r["mode"] == "prefill":
            lines.append(f"| prefill | 8B model | {r['tokens']} | {r['fp8_tok_per_s']:.0f} tok/s | "
                         f"{r['bf16_tok_per_s']:.0f} tok/s | {r['speedup_vs_bf16']:.2f} | "
                         f"W8A8 {r['w8a8_impl']}{glu_note(r)} |")
        elif r["mode"] == "w8a8_matmul":
            lines.append(f"| w8a8 int8 | {r['shape']} | {r['m']} | {r['int8_us']:.0f} us | "
                         f"{r['bf16_us']:.0f} us | {r['speedup_vs_bf16']:.2f} | INT8 dot alone "
                         f"{r['int8_dot_us']:.0f} us, {r['int8_dot_tops']:.0f} TOPS |")
        elif r["mode"] == "w8a8_prefill":
            lines.append(f"| w8a8 prefill | 8B model | {r['tokens']} | "
                         f"{r['int8_tok_per_s']:.0f} tok/s | {r['bf16_tok_per_s']:.0f} tok/s | "
                         f"{r['speedup_vs_bf16']:.2f} | INT8 W8A8, both fused{glu_note(r)} |")
        else:
            lines.append(f"| batch1 | 8B model | 1 | {r['fp8_ms']:.2f} ms | {r['bf16_ms']:.2f} ms | "
                         f"{r['speedup_vs_bf16']:.2f} | {r['frac_of_fp8_roofline']:.0%} of the "
                         f"FP8 roofline {r['fp8_roofline_ms']:.2f} ms |")
    table = "\n".join(lines)
    (out / "quant.md").write_text(table + "\n")
    print(table)
    print(f"{time.time() - t0:.0f} s; wrote {out / 'quant.json'}")


if __name__ == "__main__":
    main()
