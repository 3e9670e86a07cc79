"""How long the offline ShareGPT run would take under each pacing of the scheduler, by a step
cost model (CPU only, a few seconds a variant). The real scheduler and engine run the workload
with their compiled programs replaced by stand-ins (`host_step.stand_in_engine`); every logged
step is then priced by a model of the 8B-shaped bf16 step on an H100, fitted to the step
profiles in docs/BENCHMARKS.md ("Where a decode step's time goes"):

    step = max(weights' read, tokens x products a token) + context tokens x K/V read a token
           + tokens x elementwise a token + a fixed cost a step

The model is for choosing a policy, not for quoting: on the unpaced 1000-prompt run it predicts
20.3 s where the H100 took 22.3 s. `python -m benchmarks.pacing_model --paces 0,128,256,384`
(0: unpaced; `--sizes 1024:8192`: sequences and tokens a step as the engine picks them).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

# H100 80GB HBM3, bf16 8B-shaped model (seconds): the weights read at the copy ceiling, the
# products at the rate the 700 W cap sustains, the paged kernel at 93% of copy, norms/RoPE/SwiGLU.
WEIGHTS_S, PRODUCT_S, KV_S, ELEMENTWISE_S, FIXED_S = 5.2e-3, 20e-6, 47e-9, 3e-6, 0.6e-3
ATTN_FLOPS, ATTN_RATE = 4 * 32 * 32 * 128, 0.5e15  # a (query, key) pair, 32 layers; causal chunks


def step_s(e: dict) -> float:
    """One logged step's modeled time."""
    chunk_pairs = e["attended_tokens"] - e["decode_context"]
    return (max(WEIGHTS_S, e["tokens"] * PRODUCT_S) + e["context_tokens"] * KV_S
            + chunk_pairs * ATTN_FLOPS / ATTN_RATE + e["tokens"] * ELEMENTWISE_S + FIXED_S)


def run(pairs, pace, seqs: int, tokens: int, pages: int) -> dict:
    """The workload through the real scheduler at this pacing; its steps, priced."""
    from pallasite.serving.llm import SamplingParams
    from .host_step import stand_in_engine
    engine = stand_in_engine(num_pages=pages, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                             pace=pace or None)
    rng = np.random.default_rng(0)
    for i, (p, o) in enumerate(pairs):
        engine.add_request(f"r{i}", rng.integers(1000, 30000, p).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    engine.step_log = []
    while engine.has_unfinished():
        engine.step()
    times = [step_s(e) for e in engine.step_log]
    rows = np.array([e["tokens"] for e in engine.step_log])
    total = sum(times)
    return dict(pace=pace or None, steps=len(times), model_s=total,
                output_tok_per_s=sum(o for _, o in pairs) / total,
                steps_under_16_tokens=int((rows < 16).sum()), median_tokens=float(np.median(rows)))


def main(argv=None):
    from . import sharegpt
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--paces", default="0,128,192,256,320,384")
    ap.add_argument("--sizes", default="1024:8192", help="sequences:tokens a step")
    ap.add_argument("--pages", type=int, default=19200, help="the H100 run's KV pool")
    a = ap.parse_args(argv)
    pairs = sharegpt.load_lengths(a.prompts)
    seqs, tokens = (int(v) for v in a.sizes.split(":"))
    for pace in (int(p) for p in a.paces.split(",")):
        r = run(pairs, pace, seqs, tokens, a.pages)
        print(f"pace {r['pace'] or 'none':>4}: {r['model_s']:6.2f} s modeled, "
              f"{r['output_tok_per_s']:7.0f} output tok/s, {r['steps']} steps "
              f"({r['steps_under_16_tokens']} under 16 tokens, median {r['median_tokens']:.0f})")
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
