"""Host time of speculative verification at many sequences (CPU; a tiny model runs the steps).

Each of `--seqs` requests repeats a short random pattern, so prompt lookup proposes and is
often right; greedy, k 4, n 1..3. Prints the median CPU time of `Speculator.collect` (judging
the proposals, accepting the emitted tokens, rolling back the rest) a step, and the mean
tokens a verify step, which must not change with how the host does its work.

    python -m benchmarks.spec_host [--seqs 64] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    from pallasite.model import config_from_dict, init_params
    from pallasite.serving.engine import Engine
    from pallasite.serving.llm import SamplingParams
    config = config_from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=512))
    # Larger weights than the init: peaked logits, so the greedy text repeats its pattern.
    params = jax.tree.map(lambda x: x * 6 if x.ndim > 1 else x, init_params(config, 0))
    engine = Engine(config, params, num_pages=args.seqs * 20 + 8, page_size=16,
                    max_num_seqs=args.seqs, max_num_batched_tokens=320, max_model_len=320,
                    token_buckets=[320], page_buckets=[20],
                    speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    engine.warmup()
    rng = np.random.default_rng(0)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", rng.integers(0, 8, 12).tolist() * 4,
                           SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    times, collect = [], engine.spec.collect

    def timed(*a):
        t = time.thread_time()
        try:
            return collect(*a)
        finally:
            times.append(time.thread_time() - t)
    engine.spec.collect = timed
    for _ in range(args.steps):
        engine.step()
    rec = dict(seqs=args.seqs, steps=args.steps,
               collect_cpu_ms_median=1e3 * float(np.median(times[10:])),
               mean_tokens_a_verify_step=engine.stats()["spec_mean_accepted"])
    print(f"verification: {rec['collect_cpu_ms_median']:.2f} ms of CPU a step at {args.seqs} "
          f"sequences; {rec['mean_tokens_a_verify_step']:.2f} tokens a verify step")
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
