"""Drafts of the default model side by side: tokens per verify step on held-out documentation.

    python -m benchmarks.draft_acceptance --prompts 24 default-draft /path/to/other/draft ...

The prompts and settings of `bench_speculative`'s part 2 (k = 4, greedy, 64-token prompts from
the documents the training split held out, 128 new tokens, batch 1), for each draft folder
named, in one run: acceptance does not depend on the hardware beyond rounding, so this runs on
a CPU. Each output is checked token for token against decoding without speculation. Prints a
JSON line per draft.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.bench_speculative import K, generate_timed, held_out_documents, prompts_of


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("drafts", nargs="+", help="draft folders (or default-draft)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    from pallasite.serving.llm import LLM
    kw = dict(max_num_seqs=1, max_num_batched_tokens=256, token_buckets=[1, K + 1, 256],
              max_model_len=1024)
    docs = held_out_documents(args.prompts)
    with LLM(**kw) as plain:
        prompts = prompts_of(plain, docs, 64)
        want, _ = generate_timed(plain, prompts, args.max_tokens)
    for draft in args.drafts:
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
        with LLM(speculative_config=spec, **kw) as llm:
            got, seconds = generate_timed(llm, prompts, args.max_tokens)
            stats = llm.engine.stats()
        print(json.dumps(dict(draft=draft, mean_accepted=stats["spec_mean_accepted"],
                              acceptance_rate=stats["spec_accepted_tokens"]
                              / max(stats["spec_proposed_tokens"], 1),
                              greedy_identical=got == want, seconds=round(seconds, 1),
                              prompts=len(prompts), k=K)), flush=True)


if __name__ == "__main__":
    main()
