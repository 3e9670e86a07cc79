"""Train the draft model of the embedded default model, for speculative decoding.

Same corpus (Python's own documentation, built from the running interpreter) and the default
model's own tokenizer, so the two share a vocabulary; the same data seed and held-out split.
A 4-layer Llama, hidden 256, tied embeddings: 4.0M parameters, 8 MB in bf16.

It is distilled from the default model (`pallasite train --teacher`): trained on the target's
next-token distributions rather than on the text's next tokens, since a draft's proposals are
worth only as much as they agree with what the target picks; the exported params are those of
the lowest held-out KL, and the run logs the held-out argmax agreement.

    python -m pallasite.train.default_draft --out /tmp/draft_run --install   # GPU, ~3 minutes
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


def make_draft_dir(path: Path, target: Path) -> Path:
    """config.json (the target's vocabulary and special tokens) + the target's tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    theirs = json.loads((target / "config.json").read_text())
    config = dict(DRAFT, **{k: theirs[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).is_file():
            shutil.copyfile(target / name, path / name)
    return path


def training_args(model_dir: Path, corpus: Path, run_dir: Path, smoke: bool, seconds: float,
                  teacher: Path):
    # Soft targets carry far more than one token each and overfit much later than the text's
    # tokens (the hard-label draft's held-out loss was best at 9 of 24 epochs): 16 epochs, the
    # best held-out KL exported.
    size = (["--seq-len", "128", "--batch-size", "4", "--steps", "3", "--warmup", "1",
             "--eval-every", "3", "--eval-batches", "1"] if smoke else
            ["--seq-len", "1024", "--batch-size", "16", "--epochs", "16", "--warmup", "100",
             "--eval-every", "25", "--eval-batches", "8"])
    return ["--model", str(model_dir), "--data", str(corpus), "--out", str(run_dir), "--scratch",
            "--teacher", str(teacher), "--distill-weight", "1.0", *size, "--lr", "2e-3", "--min-lr-ratio", "0.05", "--weight-decay", "0.1",
            "--log-every", "10", "--save-every", "0", "--export-best", "--export-dtype",
            "bfloat16", "--time-budget", str(int(seconds))]


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
    parser.add_argument("--minutes", type=float, default=3.0, help="time budget of the run")
    parser.add_argument("--target", default=str(DEFAULT_DIR), help="the target model's folder")
    parser.add_argument("--corpus", help="a prepared corpus.jsonl (default: build it here)")
    parser.add_argument("--install", action="store_true",
                        help="copy the export to TARGET/draft (the shipped draft)")
    args = parser.parse_args(argv)
    from pallasite.train.default_model import summarize, write_corpus
    from pallasite.train.cli import main as train_main

    out, t0 = Path(args.out), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else out / "corpus.jsonl"
    corpus_info = {} if args.corpus else write_corpus(corpus)
    model_dir = make_draft_dir(out / "model", Path(args.target))
    cmd = training_args(model_dir, corpus, out / "run", args.smoke, args.minutes * 60,
                        Path(args.target))
    if train_main(cmd) != 0:
        sys.exit("the draft's training run failed")
    export = out / "run" / "export"
    summary = {**summarize(out / "run" / "metrics.jsonl", time.perf_counter() - t0),
               **best_agreement(out / "run" / "metrics.jsonl"), "corpus": corpus_info, "config": DRAFT,
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
