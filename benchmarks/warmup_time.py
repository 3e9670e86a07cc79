"""Warm-up time of the serving engine on a Llama-3-8B-shaped model (random bf16 weights made on
the device) with default settings, from a fresh process each time: once with JAX's persistent
compilation cache empty (every step compiled), once with it filled by that first start.

    python -m benchmarks.warmup_time --out $OUT      # GPU, about 3 minutes
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


def child(cache_dir: str):
    import jax
    import jax.numpy as jnp
    from pallasite.cli import enable_compilation_cache
    from pallasite.model import config_from_dict, init_params
    from pallasite.serving.llm import LLM
    os.environ["PALLASITE_CACHE_DIR"] = cache_dir
    enable_compilation_cache()
    config = config_from_dict(LLAMA3_8B)
    params = jax.jit(lambda: init_params(config, 0, jnp.bfloat16))()
    jax.block_until_ready(params)
    t = time.perf_counter()
    llm = LLM.from_params(config, params)
    e = llm.engine
    print(json.dumps(dict(warmup_s=time.perf_counter() - t, compilations=e.compilations,
                          token_buckets=e.token_buckets, page_buckets=e.page_buckets,
                          max_num_seqs=e.max_num_seqs)), flush=True)
    llm.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args.child)
    rec = dict(mode="warmup", model="llama3-8b-shaped", target_s=45, **run_info())
    with tempfile.TemporaryDirectory() as cache:
        for name in ("cache_empty", "cache_filled"):
            run = subprocess.run([sys.executable, "-m", "benchmarks.warmup_time", "--child",
                                  cache], capture_output=True, text=True, timeout=420)
            if run.returncode:
                rec[name] = dict(error=run.stderr[-2000:])
                print(f"{name}: FAILED\n{run.stderr[-2000:]}")
                continue
            rec[name] = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{name}: warm-up {rec[name]['warmup_s']:.1f} s, "
                  f"{rec[name]['compilations']} compilations, buckets "
                  f"{rec[name]['token_buckets']} x {rec[name]['page_buckets']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warmup.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
