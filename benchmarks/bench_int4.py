"""W4A16 on the GPU: the weight-only INT4 matmul (`kernels/int_matmul.py`, group 128) at
Llama-3-8B layer shapes for M 1..16 against bf16 (XLA's dot) and torch's tinygemm INT4
(`torch.ops.aten._weight_int4pack_mm`, group 128) timed in the same run, with the bytes each
reads over the time against the copy ceiling measured here; then batch-1 decode of the
8B-shaped model (random weights, quantized RTN g128) through `LLM.stream` against bf16.

    python -m benchmarks.bench_int4 --out DIR [--only matmul,decode,sweep] [--layers 32]

Each kernel is first checked against the jnp reference on fresh random inputs, with freed device
memory poisoned (NaN) first so an unwritten output shows. Weights rotate over enough copies to
exceed the L2 (50 MB), so every call reads them from HBM. Writes int4.json under --out and
prints a table. About 3 minutes on an H100 (the decode part builds two 8B-shaped models);
`--only sweep` times the kernel's block sizes (about 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.kernels import w4a16_matmul as im

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
MS = (1, 2, 4, 8, 16)
GROUP = 128
ROTATE_BYTES = 256 << 20  # weights of one timed call sequence: 5x the H100's L2


def poison():
    x = jnp.full((512 << 20,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def copy_tbps() -> float:
    """Bytes read + written per second by a jitted copy of 1 GiB (the ceiling we compare to)."""
    x = jnp.ones((256 << 20,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    ms = wall_ms(lambda: f(x))
    return 2 * x.nbytes / (ms * 1e-3) / 1e12


def wall_ms(call, reps=20) -> float:
    jax.block_until_ready(call())
    jax.block_until_ready(call())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def copies_for(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def jax_ms_per_call(fn, x, weights) -> float:
    """One jitted program calls `fn(x, w)` for every weight copy; time over the copies."""
    many = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    return wall_ms(lambda: many(x, weights)) / len(weights)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def int4_weights(rng, k, n, copies):
    """`copies` device buffers of one packed INT4 g128 symmetric weight (random codes)."""
    codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
    scale = rng.uniform(0.5, 1.5, (k // GROUP, n)).astype(np.float32) / 64
    words, s, _, _ = im.pack_weight(codes, scale, None, bits=4, group_size=GROUP)
    return [(jax.device_put(words), jax.device_put(s)) for _ in range(copies)]


# -- torch tinygemm ------------------------------------------------------------------------------

def torch_tinygemm(k, n, ms, copies, rng):
    """ms per call of `_weight_int4pack_mm` (group 128) for each M, CUDA graph over the copies,
    CUDA-event timing; or an error string."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA here"
    dev = torch.device("cuda")
    q = torch.from_numpy(rng.integers(0, 16, (n, k), dtype=np.uint8)).to(dev)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2])
                                                       .contiguous(), 8)
    sz = torch.rand((k // GROUP, n, 2), device=dev, dtype=torch.bfloat16) / 64
    ws = [(packed.clone(), sz.clone()) for _ in range(copies)]
    out = {}
    for m in ms:
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        run = lambda: [torch.ops.aten._weight_int4pack_mm(x, p, GROUP, sz) for p, sz in ws]
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / copies)
        out[m] = float(np.median(times))
    del ws
    torch.cuda.empty_cache()
    return out


# -- the matmul ----------------------------------------------------------------------------------

def check(rng, k, n):
    """Ours against the reference at M 1 and 13 (odd) with the output memory poisoned first."""
    (words, scale), = int4_weights(rng, k, n, 1)
    errs = []
    for m in (1, 13):
        x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
        poison()
        got = im.int_matmul(x, words, scale, bits=4, group_size=GROUP)
        want = im.int_matmul_reference(x, words, scale, bits=4, group_size=GROUP)
        errs.append(rel_err(got, want))
    return max(errs)


def bench_matmul(rng, ceiling):
    records = []
    for name, (k, n) in SHAPES.items():
        err = check(rng, k, n)
        q_bytes = k * n // 2 + (k // GROUP) * n * 4
        qs = int4_weights(rng, k, n, copies_for(q_bytes))
        bf = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16)
              for i in range(copies_for(2 * k * n))]
        tg = torch_tinygemm(k, n, MS, copies_for(q_bytes), rng)
        for m in MS:
            x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
            ours = jax_ms_per_call(lambda x, w: im.int_matmul(x, *w, bits=4, group_size=GROUP),
                                   x, qs)
            bf16 = jax_ms_per_call(lambda x, w: x @ w, x, bf)
            read = q_bytes + 2 * m * (k + n)
            rec = dict(mode="w4a16_matmul", layer=name, M=m, K=k, N=n, group_size=GROUP,
                       rel_err=err, ours_ms=ours, bf16_ms=bf16, speedup_vs_bf16=bf16 / ours,
                       bytes_read=read, tbps=read / (ours * 1e-3) / 1e12,
                       frac_of_copy=read / (ours * 1e-3) / 1e12 / ceiling,
                       splits=im.splits_for(im.block_m_for(m), n, k // im.tile_rows(4),
                                            im.block_m_for(m), 128))
            if isinstance(tg, dict):
                rec.update(tinygemm_ms=tg[m], speedup_vs_tinygemm=tg[m] / ours)
            else:
                rec["tinygemm_error"] = tg
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del qs, bf
    return records


def sweep(rng):
    """Block sizes of the kernel at two layer shapes, M 1 and 16: the fastest first."""
    records = []
    for name in ("o", "gate_up"):
        k, n = SHAPES[name]
        qs = int4_weights(rng, k, n, copies_for(k * n // 2))
        for m in (1, 16):
            x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
            for bn in (128, 256):
                for splits in (1, 2, 4, 8):
                    for stages in (3, 4):
                        kw = dict(block_n=bn, num_splits=splits, num_stages=stages)
                        try:
                            ms = jax_ms_per_call(lambda x, w: im.int_matmul(
                                x, *w, bits=4, group_size=GROUP, **kw), x, qs)
                        except Exception as e:
                            ms = float("inf")
                            print(f"{name} M={m} {kw}: {type(e).__name__}", flush=True)
                        records.append(dict(mode="w4a16_sweep", layer=name, M=m, ms=ms, **kw))
        del qs
    records.sort(key=lambda r: (r["layer"], r["M"], r["ms"]))
    for r in records:
        print(json.dumps(r), flush=True)
    return records


# -- batch-1 decode ------------------------------------------------------------------------------

def random_w4a16(params, seed=0):
    """Every dense linear weight as a random INT4 g128 PackedInt made on the device (random
    words are valid codes; RTN of random weights on the host would take minutes at 8B)."""
    from pallasite.model import quant
    from pallasite.model.quant_int import PackedInt
    key = [jax.random.key(seed)]

    def one(path, leaf):
        keys = tuple(getattr(k, "key", k) for k in path)
        axes = quant.linear_axes(keys)
        if axes is None or axes[0] != 0:
            return leaf
        k, n = int(np.prod(leaf.shape[:axes[1]])), int(np.prod(leaf.shape[axes[1]:]))
        key[0], sub = jax.random.split(key[0])
        words = jax.random.bits(sub, (im.padded_k(k, 4) // 8, n), jnp.uint32).view(jnp.int32)
        scale = jnp.full((im.padded_k(k, 4) // GROUP, n), 0.02 / 8, jnp.float32)
        return PackedInt(words, scale, None, None, tuple(leaf.shape), axes[1], 4, GROUP)
    return jax.tree_util.tree_map_with_path(one, params)


def llama3_8b(layers: int = 32, **small):
    from pallasite.model import config as mc
    return mc.ModelConfig(**{**dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0), **small})


def bench_decode(layers: int, cfg=None, tokens: int = 128, modes=("bf16", "w4a16")):
    """`modes`: bf16, w4a16 (the packed layout the engine picks here), w4a16_triton (the
    Triton kernel's layout, PALLASITE_INT_KERNEL=triton), w4a16_words (the Hopper kernel's
    words rather than int4 tiles, PALLASITE_INT4_TILES=0) and w4a16_mma (the words with their
    MMA kernel at one row too, PALLASITE_INT_GEMV=0), each in its own LLM."""
    import os

    from pallasite.model.transformer import init_params
    from pallasite.serving.llm import LLM, SamplingParams
    cfg = cfg or llama3_8b(layers)
    records = []
    for mode in modes:
        params = jax.jit(init_params, static_argnums=(0, 1, 2))(cfg, 0, jnp.bfloat16)
        if mode.startswith("w4a16"):
            params = random_w4a16(params)
        os.environ["PALLASITE_INT_KERNEL"] = "triton" if mode == "w4a16_triton" else ""
        os.environ["PALLASITE_INT_GEMV"] = "0" if mode == "w4a16_mma" else "1"
        os.environ["PALLASITE_INT4_TILES"] = "0" if mode in ("w4a16_words", "w4a16_mma") else "1"
        nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
        llm = LLM.from_params(cfg, params, max_model_len=1024, max_num_seqs=4, num_pages=256,
                              max_num_batched_tokens=128, token_buckets=[1, 128],
                              page_buckets=[64])
        del params
        prompt = list(range(1, 129))
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for _ in llm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                   ignore_eos=True)):
            pass
        stamps = [time.perf_counter() for _ in llm.stream(prompt, sp)]
        gaps = np.diff(stamps[8:])
        llm.close()
        del llm
        rec = dict(mode=f"{mode}_batch1", layers=layers, weight_bytes=nbytes,
                   ms_per_token=1e3 * float(np.median(gaps)), tokens=len(stamps))
        records.append(rec)
        print(json.dumps(rec), flush=True)
    os.environ.pop("PALLASITE_INT_KERNEL", None)
    os.environ.pop("PALLASITE_INT_GEMV", None)
    os.environ.pop("PALLASITE_INT4_TILES", None)
    if records and records[0]["mode"] == "bf16_batch1":
        for rec in records[1:]:
            rec["speedup_vs_bf16"] = records[0]["ms_per_token"] / rec["ms_per_token"]
    return records


def table(records) -> str:
    rows = ["| layer | M | ours ms | bf16 ms | tinygemm ms | vs bf16 | vs tinygemm | TB/s | of copy |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("mode") != "w4a16_matmul":
            continue
        tg = r.get("tinygemm_ms")
        tg_ms = "-" if tg is None else f"{tg:.4f}"
        tg_x = "-" if tg is None else f"{r['speedup_vs_tinygemm']:.2f}x"
        rows.append(f"| {r['layer']} | {r['M']} | {r['ours_ms']:.4f} | {r['bf16_ms']:.4f} | "
                    f"{tg_ms} | {r['speedup_vs_bf16']:.2f}x | {tg_x} | "
                    f"{r['tbps']:.2f} | {r['frac_of_copy']:.0%} |")
    for r in records:
        if r.get("mode", "").endswith("batch1"):
            rows.append(f"decode {r['mode']}: {r['ms_per_token']:.3f} ms/token, "
                        f"{r['weight_bytes'] / 1e9:.2f} GB of weights"
                        + (f", {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""))
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="matmul,decode")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--decode-modes", default="bf16,w4a16",
                    help="decode: bf16, w4a16 (the engine's layout here), w4a16_triton, "
                         "w4a16_words (the Hopper kernel's words, not int4 tiles), "
                         "w4a16_mma (the words' MMA kernel at one row too)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
               date=time.strftime("%Y-%m-%d"))
    records = []
    ceiling = copy_tbps()
    print(f"copy ceiling {ceiling:.2f} TB/s on {env['device']}", flush=True)
    parts = {"matmul": lambda: bench_matmul(rng, ceiling),
             "decode": lambda: bench_decode(args.layers, modes=args.decode_modes.split(",")), "sweep": lambda: sweep(rng)}
    for part in args.only.split(","):
        try:
            records += parts[part]()
        except Exception as e:  # report and go on: the other part's numbers still count
            traceback.print_exc()
            records.append(dict(mode=part, error=f"{type(e).__name__}: {e}"))
    for r in records:
        r.update(env, copy_tbps=ceiling)
    (out / "int4.json").write_text(json.dumps(records, indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
