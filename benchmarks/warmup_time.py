"""Warm-up time of the serving engine on a Llama-3-8B-shaped model (random bf16 weights made on
the device) with the engine's own sizes, each start a fresh process: the persistent compilation
cache off; on and empty (cold: every program compiled and stored); on and filled by that start
(warm: every program loaded). Each start then serves a few greedy, seeded top-p and
logit-biased requests and must compile nothing.

    python -m benchmarks.warmup_time --out $OUT      # GPU, about 4-5 minutes on an H100
    python -m benchmarks.warmup_time --plan          # the GPU programs, listed (no compiling)
    python -m benchmarks.warmup_time --tiny --out /tmp/w   # a 2-layer model: CPU-sized check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import run_info

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
TINY_SIZES = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=64, max_model_len=256)
STARTS = (("cache_off", False), ("cache_cold", True), ("cache_warm", True))


def gpu_plan(model: dict = LLAMA3_8B, page_size: int = 16, num_pages: int = 19334):
    """The programs the GPU warm-up compiles for this model with the engine's GPU sizes (the
    pool size is the one an H100 gave; it sets only the sequence limit, 1024 here)."""
    from pallasite.serving.settings import GPU_BUDGET, GPU_MAX_SEQS, TOKENS_PER_SEQ, \
        gpu_token_buckets
    from pallasite.serving.engine import MIN_TOKEN_BUCKET
    from pallasite.serving.warmup import default_page_buckets, plan
    max_len = min(model["max_position_embeddings"], 8192)
    seqs = max(32, min(GPU_MAX_SEQS, 1 << (num_pages * page_size // TOKENS_PER_SEQ).bit_length()
                       - 1))
    budget = max(GPU_BUDGET, seqs)
    tokens = sorted({max(MIN_TOKEN_BUCKET, b) for b in gpu_token_buckets(budget, seqs)})
    pages = default_page_buckets(-(-max_len // page_size), gpu=True)
    return dict(token_buckets=tokens, page_buckets=pages, max_num_seqs=seqs,
                programs=plan(tokens, pages, seqs, page_size))


def child(cache_dir: str, tiny: bool):
    import jax
    import jax.numpy as jnp
    from pallasite.model import config_from_dict, init_params
    from pallasite.serving.api import SamplingParams
    from pallasite.serving.llm import LLM
    from pallasite.serving.warmup import CompileCounter
    os.environ["PALLASITE_CACHE_DIR"] = cache_dir  # "": off
    config = config_from_dict(TINY if tiny else LLAMA3_8B)
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    jax.block_until_ready(params)
    t = time.perf_counter()
    llm = LLM.from_params(config, params, **(TINY_SIZES if tiny else {}))
    wall = time.perf_counter() - t
    e = llm.engine
    prompts = [[1 + (7 * i + j) % 500 for j in range(5 + 40 * i)] for i in range(3)]
    kinds = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0, logit_bias={3: 5.0}, ignore_eos=True)]
    warm = e.compilations
    with CompileCounter() as after:
        t = time.perf_counter()
        outs = llm.generate(prompts, kinds)
        first_s = time.perf_counter() - t
    assert all(len(o.token_ids) == 8 for o in outs), "a request came back short"
    rep = e.warmup_report
    print(json.dumps(dict(
        warmup_s=wall, engine_warmup_s=rep["seconds"], programs=rep["programs"],
        cache_hits=rep["cache_hits"], jax_compiles=rep["jax_compiles"], slowest=rep["slowest"],
        lowering_s=rep["lowering_s"],
        compiles_after_warmup=after.compiles + e.compilations - warm,
        first_requests_s=first_s, token_buckets=e.token_buckets, page_buckets=e.page_buckets,
        max_num_seqs=e.max_num_seqs, num_pages=e.pages.num_pages)), flush=True)
    llm.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--plan", action="store_true", help="list the GPU warm-up's programs and stop")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model with small sizes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.tiny)
    if args.plan:
        got = gpu_plan()
        for name, why in got["programs"]:
            print(f"{name:32s} {why}")
        print(f"{len(got['programs'])} programs: token buckets {got['token_buckets']} x page "
              f"buckets {got['page_buckets']}, {got['max_num_seqs']} sequences")
        return got
    rec = dict(mode="warmup", model="tiny" if args.tiny else "llama3-8b-shaped", target_s=45,
               **run_info())
    with tempfile.TemporaryDirectory() as cache:
        for name, on in STARTS:
            cmd = [sys.executable, "-m", "benchmarks.warmup_time", "--child", cache if on else ""]
            run = subprocess.run(cmd + ["--tiny"] * args.tiny, capture_output=True, text=True,
                                 timeout=280)
            if run.returncode:
                rec[name] = dict(error=run.stderr[-3000:])
                print(f"{name}: FAILED\n{run.stderr[-3000:]}", flush=True)
                continue
            r = rec[name] = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{name:10s} warm-up {r['warmup_s']:6.1f} s  {r['programs']} programs, "
                  f"{r['cache_hits']} cache hits, {r['lowering_s']:.0f} s tracing (summed), "
                  f"compiles after warm-up {r['compiles_after_warmup']}; slowest "
                  f"{r['slowest'][:3]}", flush=True)
    ok = [rec[n] for n, _ in STARTS if "error" not in rec[n]]
    if ok:
        print(f"buckets {ok[0]['token_buckets']} x {ok[0]['page_buckets']}, "
              f"{ok[0]['max_num_seqs']} sequences, {ok[0]['num_pages']} pages")
    rec["no_compile_after_warmup"] = bool(ok) and all(r["compiles_after_warmup"] == 0 for r in ok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warmup.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(f"no compilation after warm-up: {rec['no_compile_after_warmup']}")


if __name__ == "__main__":
    main()
