"""`pallasite train`: train (or fine-tune) a model folder on text or JSONL files.

    pallasite train --model DIR --data corpus.jsonl --out runs/x --steps 2000
    pallasite train --model DIR --data corpus.jsonl --out runs/d --teacher BIG_DIR   # distill

DIR holds config.json and tokenizer.json (and weights, unless --scratch). The run writes
OUT/metrics.jsonl, OUT/checkpoints/ (resumed automatically when present) and OUT/export/, a
Hugging Face folder that `pallasite generate --model OUT/export` and `transformers` load.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", required=True, help="folder with config.json and tokenizer.json")
    p.add_argument("--data", nargs="+", required=True, help=".txt files or .jsonl ({\"text\"})")
    p.add_argument("--train-extra", nargs="+", default=None,
                   help="more files whose documents join the training rows only (the held-out "
                        "rows stay those of --data)")
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics, export")
    p.add_argument("--scratch", action="store_true", help="random init even if DIR has weights")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per row (default: the context, at most 1024)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--epochs", type=float, default=None, help="passes over the data (sets --steps)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=500, help="steps; 0: no checkpoints")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--mesh", default="1,1,1", help="data,tensor,expert device counts")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (master weights stay float32); auto: bf16 on GPU")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--export-best", action="store_true",
                   help="export the params of the lowest held-out loss seen, not the last")
    p.add_argument("--teacher", default=None, metavar="DIR",
                   help="distill: train against this model's next-token distributions (a "
                        "model folder with weights and the same vocabulary)")
    p.add_argument("--distill-weight", type=float, default=1.0,
                   help="with --teacher: weight of the KL term; 1 - it goes to the data's "
                        "cross-entropy")
    p.add_argument("--distill-temperature", type=float, default=1.0,
                   help="with --teacher: softmax temperature of both distributions")
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true")


def run(args) -> int:
    from .job import USER_ERRORS, train  # imports JAX: only when a run starts
    try:
        train(args)
        return 0
    except USER_ERRORS as e:
        print(f"pallasite train: error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pallasite train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
