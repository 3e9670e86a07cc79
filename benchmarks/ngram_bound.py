"""How far prompt lookup can go on the copy-heavy workload, and what bounds it.

    python -m benchmarks.ngram_bound --out DIR [--prompts 12] [--max-tokens 128]

The default model, greedy, float32 (acceptance depends on the hardware only through rounding):
the plain outputs of `bench_speculative`'s copy-heavy prompts (a held-out document, a blank
line, its first 32 tokens again). Each output is then replayed, k = 4, with three proposers:

- lookup: the engine's own (`ngram_propose`, n 4 down to 1, the latest match);
- best match: of every earlier occurrence of the last n >= 1 tokens, the one whose followers
  agree with the output longest (no prompt lookup can do better);
- copy: the document's own continuation where the copy stands (what a faithful copy accepts).

For each: tokens a verify step and tokens a step over the whole output. And how much of each
output is a copy: the share of its tokens equal to the document's at the same offset, and the
length of its first copied run. Writes DIR/ngram_bound.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from pallasite.serving.speculative import ngram_propose

from .bench_speculative import K, generate_timed, held_out_documents, prompts_of

SOURCE = 192  # tokens of the document in the prompt
REPEAT = 32  # of which the prompt repeats the first


def replay(prompt, out, propose) -> tuple[int, int, int]:
    """(verify steps, tokens they emitted, all steps) decoding `out` after `prompt` with a
    proposer; a step without a proposal emits one token."""
    t = verify = emitted = steps = 0
    while t < len(out):
        proposal = propose(prompt + out[:t], t)
        steps += 1
        if not proposal:
            t += 1
            continue
        agree = next((i for i, (a, b) in enumerate(zip(proposal, out[t:])) if a != b),
                     min(len(proposal), len(out) - t))
        n = min(agree + 1, len(out) - t)  # the accepted ones and the model's own next token
        verify, emitted, t = verify + 1, emitted + n, t + n
    return verify, emitted, steps


def best_match(context, out_rest) -> list[int]:
    """Of all earlier occurrences of the last n tokens (n 4 down to 1), the proposal that
    agrees with the output longest."""
    best, best_len, L = [], -1, len(context)
    for n in range(min(4, L - 1), 0, -1):
        tail = context[L - n:]
        for j in range(n, L):
            if context[j - n:j] == tail:
                p = context[j:j + K]
                agree = next((i for i, (a, b) in enumerate(zip(p, out_rest)) if a != b),
                             min(len(p), len(out_rest)))
                if agree > best_len:
                    best, best_len = p, agree
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    from pallasite.serving.llm import LLM
    docs = held_out_documents(args.prompts)
    kw = dict(max_num_seqs=1, max_num_batched_tokens=256, token_buckets=[1, 256],
              max_model_len=1024)
    with LLM(**kw) as llm:
        sources = prompts_of(llm, docs, SOURCE)
        copy = [(s + llm.tokenizer.encode("\n\n") + s[:REPEAT])[:1024 - args.max_tokens]
                for s in sources]
        outs, _ = generate_timed(llm, copy, args.max_tokens)
    proposers = {  # (document, output) -> propose(context, output position)
        "lookup": lambda src, out: lambda ctx, t: ngram_propose(ctx, K, 1, 4),
        "best match": lambda src, out: lambda ctx, t: best_match(ctx, out[t:]),
        "copy": lambda src, out: lambda ctx, t: src[REPEAT + t:REPEAT + t + K],
    }
    totals = {name: np.zeros(3) for name in proposers}
    share, runs = [], []
    for src, prompt, out in zip(sources, copy, outs):
        for name, make in proposers.items():
            totals[name] += replay(prompt, out, make(src, out))
        same = [a == b for a, b in zip(out, src[REPEAT:])]
        share.append(float(np.mean(same)) if same else 0.0)
        runs.append(next((i for i, s in enumerate(same) if not s), len(same)))
    n_out = sum(len(o) for o in outs)
    rec = dict(prompts=len(outs), max_tokens=args.max_tokens, k=K, output_tokens=n_out,
               copy_share=float(np.mean(share)), first_copy_run_median=float(np.median(runs)),
               first_copy_runs=runs, proposers={
                   name: dict(verify_steps=int(v), tokens_a_verify_step=e / max(v, 1),
                              tokens_a_step=n_out / s)
                   for name, (v, e, s) in totals.items()})
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ngram_bound.json").write_text(json.dumps(rec, indent=1))
    print(f"{len(outs)} copy-heavy prompts, {n_out} output tokens; {100 * rec['copy_share']:.0f}%"
          f" of them the document's own at their offset; first copied run: median "
          f"{rec['first_copy_run_median']:.0f} tokens ({runs})")
    print("| proposer | verify steps | tokens a verify step | tokens a step |")
    print("|---|---|---|---|")
    for name, r in rec["proposers"].items():
        print(f"| {name} | {r['verify_steps']} | {r['tokens_a_verify_step']:.2f} | "
              f"{r['tokens_a_step']:.2f} |")


if __name__ == "__main__":
    main()
