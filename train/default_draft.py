"""Train the draft model of the embedded default model, for speculative decoding.

Same corpus (Python's own documentation, built from the running interpreter) and the default
model's own tokenizer, so the two share a vocabulary; the same data seed and held-out split.
A 4-layer Llama, hidden 256, tied embeddings: 4.0M parameters, 8 MB in bf16.

It is distilled from the default model (`pallasite train --teacher`): trained on the target's
next-token distributions rather than on the text's next tokens, since a draft's proposals are
worth only as much as they agree with what the target picks; the exported params are those of
the lowest held-out KL, and the run logs the held-out argmax agreement. Its training rows also
hold the target's own greedy continuations of 4000 training documents' beginnings
(`--generated`), the kind of text a draft proposes for.

    python -m pallasite.train.default_draft --out /tmp/draft_run --install   # GPU, ~4 minutes
    python -m pallasite.train.default_draft --out /tmp/draft_smoke --smoke   # CPU check

--install copies the export to model/default_model/draft/, where
`"model": "default-draft"` in a speculative config finds it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "model" / "default_model"
DRAFT = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
             intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu")


def draft_config(hidden: int, layers: int, intermediate: int) -> dict:
    """DRAFT resized: heads of 64, one KV head."""
    return dict(DRAFT, hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=intermediate, num_attention_heads=hidden // 64)


def make_draft_dir(path: Path, target: Path, draft: dict = DRAFT) -> Path:
    """config.json (the target's vocabulary and special tokens) + the target's tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    theirs = json.loads((target / "config.json").read_text())
    config = dict(draft, **{k: theirs[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).is_file():
            shutil.copyfile(target / name, path / name)
    return path


def write_generated(path: Path, corpus: Path, target: Path, max_prompts: int, new_tokens: int,
                    seed: int = 0, eval_fraction: float = 0.05, sampled: int = 0,
                    temperature: float = 1.0) -> dict:
    """The target's own greedy continuations of the beginnings of training documents, as a
    corpus. Speculation proposes for text the target writes, which is more predictable than
    the documentation it learned from; a draft that also learns that text agrees with it more.
    Only documents wholly inside the training rows (the same shuffle as `build_dataset`, with
    room to spare before the held-out end) give prompts, so no held-out text leaks in.
    `sampled` more continuations of each prompt are drawn at `temperature` (seeded): text near
    the target's own that the greedy path alone never reaches, with the target's distributions
    as labels all the same."""
    import numpy as np
    from pallasite.serving.llm import LLM, SamplingParams
    from pallasite.train.data import read_documents
    llm = LLM(str(target))
    docs = read_documents([corpus])
    ids = [llm.tokenizer.encode(d) for d in docs]
    order = np.random.default_rng(seed).permutation(len(docs))
    ends = np.cumsum([len(ids[i]) + 1 for i in order])
    train = [ids[i] for i, end in zip(order, ends) if end < (1 - 2 * eval_fraction) * ends[-1]]
    prompts = [d[:min(48, len(d) // 2)] for d in train if len(d) >= 24][:max_prompts]
    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0)] * len(prompts) + [
        SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=seed + i)
        for i in range(sampled * len(prompts))]
    prompts = prompts * (1 + sampled)
    outs = llm.generate(prompts, params)
    llm.close()
    with open(path, "w") as f:
        for p, o in zip(prompts, outs):
            f.write(json.dumps({"text": llm.tokenizer.decode(p + o.token_ids)}) + "\n")
    return {"generated_documents": len(prompts),
            "generated_tokens": sum(len(o.token_ids) for o in outs),
            "sampled_per_prompt": sampled, "sampled_temperature": temperature}


def training_args(model_dir: Path, corpus: Path, run_dir: Path, smoke: bool, seconds: float,
                  teacher: Path, epochs: int = 16, extra: Path | None = None):
    # Soft targets carry far more than one token each and overfit much later than the text's
    # tokens (the hard-label draft's held-out loss was best at 9 of 24 epochs): 16 epochs, the
    # best held-out KL exported.
    size = (["--seq-len", "128", "--batch-size", "4", "--steps", "3", "--warmup", "1",
             "--eval-every", "3", "--eval-batches", "1"] if smoke else
            ["--seq-len", "1024", "--batch-size", "16", "--epochs", str(epochs), "--warmup", "100",
             "--eval-every", "25", "--eval-batches", "8"])
    return ["--model", str(model_dir), "--data", str(corpus), "--out", str(run_dir), "--scratch",
            "--teacher", str(teacher), "--distill-weight", "1.0", *size, "--lr", "2e-3", "--min-lr-ratio", "0.05", "--weight-decay", "0.1",
            "--log-every", "10", "--save-every", "0", "--export-best", "--export-dtype",
            "bfloat16", "--time-budget", str(int(seconds))] + (
                ["--train-extra", str(extra)] if extra else [])


def best_agreement(metrics: Path) -> dict:
    """At the exported (lowest held-out KL) evaluation: KL, the text's cross-entropy, and how
    often the draft's argmax is the target's."""
    held = [r for r in map(json.loads, metrics.read_text().splitlines()) if "eval_kl" in r]
    if not held:
        return {}
    best = min(held, key=lambda r: r["eval_loss"])
    return {"best_eval_kl": best["eval_kl"], "best_eval_ce": best["eval_ce"],
            "best_eval_agreement": best["eval_agree"],
            "final_eval_agreement": held[-1]["eval_agree"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="a few steps (CPU check)")
    parser.add_argument("--minutes", type=float, default=4.0, help="time budget of the run")
    parser.add_argument("--target", default=str(DEFAULT_DIR), help="the target model's folder")
    parser.add_argument("--corpus", help="a prepared corpus.jsonl (default: build it here)")
    parser.add_argument("--install", action="store_true",
                        help="copy the export to TARGET/draft (the shipped draft)")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--generated", type=int, default=4000, metavar="N",
                        help="also train on the target's greedy continuations of N training "
                             "documents' beginnings (0: none; --smoke: 8)")
    parser.add_argument("--generated-tokens", type=int, default=192)
    parser.add_argument("--generated-file", metavar="JSONL",
                        help="the continuations of an earlier run (its generated.jsonl), reused")
    parser.add_argument("--sampled", type=int, default=0, metavar="N",
                        help="N more continuations of each prompt, sampled at --temperature")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=DRAFT["hidden_size"])
    parser.add_argument("--layers", type=int, default=DRAFT["num_hidden_layers"])
    parser.add_argument("--intermediate", type=int, default=DRAFT["intermediate_size"])
    args = parser.parse_args(argv)
    from pallasite.train.default_model import summarize, write_corpus
    from pallasite.train.cli import main as train_main

    out, t0 = Path(args.out), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else out / "corpus.jsonl"
    corpus_info = {} if args.corpus else write_corpus(corpus)
    extra = out / "generated.jsonl" if args.generated else None
    if args.generated_file:
        extra = Path(args.generated_file)
    elif extra:
        n, tokens = (8, 16) if args.smoke else (args.generated, args.generated_tokens)
        corpus_info |= write_generated(extra, corpus, Path(args.target), n, tokens,
                                       sampled=args.sampled, temperature=args.temperature)
    draft = draft_config(args.hidden, args.layers, args.intermediate)
    model_dir = make_draft_dir(out / "model", Path(args.target), draft)
    cmd = training_args(model_dir, corpus, out / "run", args.smoke, args.minutes * 60,
                        Path(args.target), args.epochs, extra)
    if train_main(cmd) != 0:
        sys.exit("the draft's training run failed")
    export = out / "run" / "export"
    summary = {**summarize(out / "run" / "metrics.jsonl", time.perf_counter() - t0),
               **best_agreement(out / "run" / "metrics.jsonl"), "corpus": corpus_info, "config": draft,
               "command": "python -m pallasite.train.default_draft " + " ".join(
                   argv if argv is not None else sys.argv[1:])}
    (export / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    if args.install:
        dest = Path(args.target) / "draft"
        # Weights and config only: the draft shares the default model's tokenizer beside it.
        shutil.copytree(export, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("tokenizer*"))
        print(f"installed the draft in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
