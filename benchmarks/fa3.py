"""FlashAttention-3 beside our kernels, in the same process on the same inputs (`bench_kernels
--only fa3`): flash prefill (causal and full, S 1k to 16k), the paged decode grid (batch 1 to 128
by context 1k to 32k) and the mixed chunked-prefill step.

FA3 comes from the `flash-attn3-jax` wheel (JAX FFI, Hopper, head dim 128), an optional
benchmark-only dependency: without it this part says so and is skipped. Its paged cache is
[pages, page_size, KV, D] where ours is [KV, pages, page_size, D]: the pages are converted once,
outside the timed calls. FA3 gets its best `num_splits` per point, as a tuned deployment would.
Times are the GPU time of each call's kernels with the L2 flushed before it (`common.device_ms`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .attention import K, dense_inputs, log, paged_inputs, reference, try_time
from .common import DEVICE_KERNELS, poison, rel_err

H, KV, D, PAGE = 32, 8, 128, 16
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (1024, 4096, 8192, 32768)
SPLITS = (1, 4, 16)  # FA3 gets the best of these where B x KV heads leave SMs idle


def fa3():
    """The flash_attn3_jax module, or None (with the reason logged)."""
    try:
        import flash_attn3_jax
        return flash_attn3_jax
    except Exception as e:  # absent, or its library does not load here
        log(f"fa3: flash-attn3-jax not usable ({type(e).__name__}: {str(e)[:200]}): skipped")
        return None


def fa3_pages(pages):
    return jnp.transpose(pages, (1, 2, 0, 3))  # [KV, P, ps, D] -> [P, ps, KV, D]


def best_fa3_decode(f, q, kc, vc, ctx, table, splits=SPLITS):
    """(best ms, its num_splits, ms by splits) of FA3's paged decode; q [B, H, D]."""
    by = {}
    for n in splits:
        call = lambda q, kc, vc, ctx, table, n=n: f.flash_mha_with_kvcache(
            q[:, None], kc, vc, cache_seqlens=ctx, page_table=table, is_causal=True,
            num_splits=n)[:, 0]
        by[n] = try_time(f"fa3 splits={n}", call, q, kc, vc, ctx, table, device=True)
    ok = {n: t for n, t in by.items() if t is not None}
    n = min(ok, key=ok.get) if ok else None
    return (ok[n] if ok else None), n, by


def prefill(f, records, record, quick):
    key = jax.random.PRNGKey(11)
    for S in ((1024, 4096) if quick else (1024, 2048, 4096, 8192, 16384)):
        B = max(1, 16384 // S)  # 16k tokens a batch
        for causal in (True, False):
            key, sub = jax.random.split(key)
            q, k, v = dense_inputs(sub, B, S, S, H, KV, D, jnp.bfloat16)
            ours = lambda q, k, v: K.flash_attention(q, k, v, causal=causal, impl="pallas")
            theirs = lambda q, k, v: f.flash_mha(q, k, v, is_causal=causal)
            cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                 implementation="cudnn")
            poison()
            out = jax.jit(ours)(q, k, v)
            err = rel_err(jax.jit(theirs)(q, k, v), out)  # FA3 against ours: same function
            t = {n: try_time(n, fn, q, k, v, device=True)
                 for n, fn in (("ours", ours), ("fa3", theirs), ("cudnn", cudnn))}
            flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
            tf = {n: flops / (ms / 1e3) / 1e12 for n, ms in t.items() if ms}
            records.append(record("flash_attention", batch=B, seq=S, heads=H, kv_heads=KV,
                                  head_dim=D, causal=causal, dtype="bfloat16", ours_ms=t["ours"],
                                  baselines={"fa3": t["fa3"], "cudnn": t["cudnn"]},
                                  fa3_vs_ours_rel_err=err, tflops=tf, timing="device",
                                  ratio_vs_fa3=t["fa3"] / t["ours"] if t["ours"] and t["fa3"]
                                  else None, part="fa3"))
            log(f"fa3 prefill S={S} B={B} causal={causal} ms={t} TFLOP/s={tf} err={err}")
            del q, k, v, out


def decode(f, records, record, ceiling, quick):
    rng = np.random.default_rng(12)
    grid = [(b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS if b * c <= 128 * 32768]
    if quick:
        grid = [(1, 32768), (8, 8192), (64, 4096)]
    for B, C in grid:
        q, kp, vp, _, ctx, table = paged_inputs(rng, [1] * B, [C] * B, H, KV, D, PAGE,
                                               jnp.bfloat16)
        q = q.reshape(B, H, D)
        kc, vc = fa3_pages(kp), fa3_pages(vp)
        ours = lambda q, kp, vp, ctx, table: K.paged_attention(q, kp, vp, ctx, table,
                                                               impl="pallas")
        poison()
        out = jax.jit(ours)(q, kp, vp, ctx, table)
        err = rel_err(out, jax.jit(reference.paged_attention_reference)(q, kp, vp, ctx, table)) \
            if B * C <= 64 * 8192 else None
        ms = try_time("ours", ours, q, kp, vp, ctx, table, device=True)
        launched = list(DEVICE_KERNELS)
        splits = SPLITS if B * KV < 132 else (1, 2)
        fa3_ms, n, by = best_fa3_decode(f, q, kc, vc, ctx, table, splits)
        fa3_err = None
        if n is not None:
            fa3_err = rel_err(jax.jit(lambda *a: f.flash_mha_with_kvcache(
                a[0][:, None], *a[1:3], cache_seqlens=a[3], page_table=a[4], is_causal=True,
                num_splits=n)[:, 0])(q, kc, vc, ctx, table), out)
        tbps = 2 * B * C * KV * D * 2 / (ms / 1e3) / 1e12 if ms else None
        records.append(record("paged_attention", batch=B, context=C, page_size=PAGE, heads=H,
                              kv_heads=KV, head_dim=D, dtype="bfloat16", ours_ms=ms,
                              baselines={"fa3": fa3_ms}, fa3_num_splits=n, fa3_by_splits=by,
                              rel_err=err, fa3_vs_ours_rel_err=fa3_err, tbps=tbps,
                              frac_of_copy_bw=tbps / ceiling if tbps else None,
                              kernels_launched=launched, timing="device", part="fa3",
                              ratio_vs_fa3=fa3_ms / ms if ms and fa3_ms else None))
        log(f"fa3 decode B={B} C={C} ours={ms} fa3={fa3_ms} (splits {n}) err={err} "
            f"fa3_err={fa3_err}")
        del q, kp, vp, kc, vc, out


def two_calls(f, chunk: int, num_splits: int):
    """FA3 on a mixed step whose first sequence is a `chunk`-token prefill and the rest decode
    rows: a chunk call (causal) and a decode call, (q, kc, vc, ctx, table) -> [T, H, D]."""
    def call(q, kc, vc, ctx, table):
        a = f.flash_mha_with_kvcache(q[None, :chunk], kc, vc, cache_seqlens=ctx[:1],
                                     page_table=table[:1], is_causal=True, num_splits=num_splits)
        b = f.flash_mha_with_kvcache(q[chunk:, None], kc, vc, cache_seqlens=ctx[1:],
                                     page_table=table[1:], is_causal=True, num_splits=num_splits)
        return jnp.concatenate([a[0], b[:, 0]])
    return call


def mixed(f, records, record):
    """A 512-token chunk over 8k of context plus 63 decode rows at 4k: ours in one ragged call,
    FA3 as a chunk call (512 query rows, causal) and a decode call."""
    rng = np.random.default_rng(13)
    q_lens, ctx = [512] + [1] * 63, [8192] + [4096] * 63
    q, kp, vp, qs, ctx, table = paged_inputs(rng, q_lens, ctx, H, KV, D, PAGE, jnp.bfloat16)
    kc, vc = fa3_pages(kp), fa3_pages(vp)
    ours = lambda q, kp, vp, qs, ctx, table: K.ragged_paged_attention(q, kp, vp, qs, ctx, table,
                                                                      impl="pallas")
    poison()
    out = jax.jit(ours)(q, kp, vp, qs, ctx, table)
    err = rel_err(out, jax.jit(reference.ragged_paged_attention_reference)(
        q, kp, vp, qs, ctx, table))
    ms = try_time("ours mixed", ours, q, kp, vp, qs, ctx, table, device=True)
    best = {n: try_time(f"fa3 mixed splits={n}", two_calls(f, 512, n), q, kc, vc, ctx, table,
                        device=True) for n in (1, 2, 4)}
    ok = {n: t for n, t in best.items() if t is not None}
    fa3_ms = min(ok.values()) if ok else None
    records.append(record("ragged_paged_attention", batch=64, seq=512, context=8192,
                          page_size=PAGE, dtype="bfloat16", ours_ms=ms, rel_err=err,
                          baselines={"fa3_two_calls": fa3_ms}, fa3_by_splits=best,
                          parts=mixed_parts(f, q, kp, vp, kc, vc, qs, ctx, table),
                          backend="mosaic" if K._ragged_mosaic(q, kp, table, set(), True) else "triton",
                          timing="device", part="fa3",
                          ratio_vs_fa3=fa3_ms / ms if ms and fa3_ms else None,
                          note="512-token chunk over 8k + 63 decode rows at 4k"))
    log(f"fa3 mixed ours={ms} fa3={best} err={err}")


def mixed_parts(f, q, kp, vp, kc, vc, qs, ctx, table) -> dict:
    """The mixed step's two halves apart, ms: the chunk alone and the decode rows alone, ours
    (the ragged call on each half; the decode rows also through the paged decode kernel) and
    FA3's (its best splits), to say which half a gap comes from."""
    ragged = lambda q, kp, vp, qs, ctx, table: K.ragged_paged_attention(
        q, kp, vp, qs, ctx, table, impl="pallas")
    rows_q, rows_qs = q[512:], qs[1:] - 512
    out = dict(
        ours_chunk=try_time("ours chunk", ragged, q[:512], kp, vp, qs[:2], ctx[:1], table[:1],
                            device=True),
        ours_rows=try_time("ours rows", ragged, rows_q, kp, vp, rows_qs, ctx[1:], table[1:],
                           device=True),
        ours_rows_decode_kernel=try_time("ours rows (decode kernel)", lambda *a: K.paged_attention(
            *a, impl="pallas"), rows_q, kp, vp, ctx[1:], table[1:], device=True))
    for n in (1, 2, 4):
        chunk = lambda q, kc, vc, ctx, table, n=n: f.flash_mha_with_kvcache(
            q[None], kc, vc, cache_seqlens=ctx, page_table=table, is_causal=True, num_splits=n)
        out[f"fa3_chunk_splits{n}"] = try_time("fa3 chunk", chunk, q[:512], kc, vc, ctx[:1],
                                               table[:1], device=True)
    out["fa3_rows"] = best_fa3_decode(f, rows_q, kc, vc, ctx[1:], table[1:], (1, 2, 4))[0]
    log(f"fa3 mixed parts {out}")
    return out


def bench_fa3(args, records, ceiling, record):
    f = fa3()
    if f is None:
        return
    for name, part in (("mixed", lambda: mixed(f, records, record)),
                       ("decode", lambda: decode(f, records, record, ceiling, args.quick)),
                       ("prefill", lambda: prefill(f, records, record, args.quick))):
        if name not in args.fa3_parts.split(","):
            continue
        try:
            part()
        except Exception:
            import traceback
            log(f"fa3 {name} FAILED: {traceback.format_exc()[-1500:]}")


def fa3_table(records) -> str:
    """Markdown: each point's time, FA3's best time and the ratio (above 1: ours is faster)."""
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"
    r0 = records[0]
    lines = [f"FlashAttention-3 in the same run: {r0['gpu']}, JAX {r0['jax_version']}, "
             f"{r0['date']}", "", "| case | ours ms | FA3 ms | FA3 splits | ours / FA3 speed |",
             "|---|---|---|---|---|"]
    ratios = []
    for r in records:
        if r["kernel"] == "flash_attention":
            case = f"prefill S={r['seq']} B={r['batch']} {'causal' if r['causal'] else 'full'}"
        elif r["kernel"] == "paged_attention":
            case = f"decode B={r['batch']} ctx={r['context']}"
            if r["ratio_vs_fa3"]:
                ratios.append(r["ratio_vs_fa3"])
        else:
            case = "mixed: 512-token chunk over 8k + 63 decode rows at 4k"
        lines.append(f"| {case} | {f(r['ours_ms'], 4)} | {f(list(r['baselines'].values())[0], 4)} "
                     f"| {r.get('fa3_num_splits', '-')} | {f(r['ratio_vs_fa3'], 2)}x |")
    if ratios:
        geo = float(np.exp(np.mean(np.log(ratios))))
        lines += ["", f"decode grid: geometric mean {geo:.2f}x FA3, worst {min(ratios):.2f}x, "
                      f"{sum(x >= 1 for x in ratios)}/{len(ratios)} points at or above 1.0x"]
    return "\n".join(lines)
