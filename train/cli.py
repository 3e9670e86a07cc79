"""`pallasite train`: train (or fine-tune) a model folder on text or JSONL files.

    pallasite train --model DIR --data corpus.jsonl --out runs/x --steps 2000

DIR holds config.json and tokenizer.json (and weights, unless --scratch). The run writes
OUT/metrics.jsonl, OUT/checkpoints/ (resumed automatically when present) and OUT/export/, a
Hugging Face folder that `pallasite generate --model OUT/export` and `transformers` load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .data import DataError


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", required=True, help="folder with config.json and tokenizer.json")
    p.add_argument("--data", nargs="+", required=True, help=".txt files or .jsonl ({\"text\"})")
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics, export")
    p.add_argument("--scratch", action="store_true", help="random init even if DIR has weights")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per row (default: the context, at most 1024)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=1000)
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
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--mesh", default="1,1,1", help="data,tensor,expert device counts")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (master weights stay float32); auto: bf16 on GPU")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true")


def run(args) -> int:
    try:
        return _run(args)
    except (DataError, ValueError, RuntimeError) as e:
        print(f"pallasite train: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    # Training differentiates through attention; the jnp reference has gradients everywhere.
    os.environ.setdefault("PALLASITE_ATTENTION_IMPL", "reference")
    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from ..model import init_params, load_config, load_hf, to_hf_dict
    from .checkpoint import Checkpoints
    from .data import build_dataset
    from .export import export_hf
    from .loop import LoopSettings, run_loop
    from .mesh import make_mesh
    from .step import Hyper, Trainer

    model_dir, out = Path(args.model), Path(args.out)
    config = load_config(model_dir)
    args.seq_len = args.seq_len or min(config.max_position_embeddings, 1024)
    check_seq_len(args.seq_len, config)
    if not config.eos_token_ids:
        raise DataError(f"{model_dir}/config.json has no eos_token_id to end documents with")
    if not (model_dir / "tokenizer.json").is_file():
        raise DataError(f"no tokenizer.json in {model_dir}")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    data = build_dataset(args.data, tokenizer, config.eos_token_ids[0], args.seq_len, args.seed,
                         args.eval_fraction)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    say(f"data: {data.num_docs} documents, {data.num_tokens} tokens, "
        f"{len(data.train['inputs'])} train / {len(data.eval['inputs'])} eval rows of {args.seq_len}")

    mesh = make_mesh(*parse_mesh(args.mesh))
    on_gpu = jax.default_backend() == "gpu"
    dtype = {"auto": jnp.bfloat16 if on_gpu else jnp.float32, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[args.dtype]
    hyper = Hyper(args.lr, args.min_lr_ratio, args.warmup, args.steps, args.weight_decay,
                  clip=args.clip)
    trainer = Trainer(config, hyper, mesh, dtype)

    checkpoints = Checkpoints(out / "checkpoints", args.save_every, args.keep)
    meta = json.loads(json.dumps({
        "model": to_hf_dict(config), "hyper": dataclasses.asdict(hyper),
        "seq_len": args.seq_len, "batch_size": args.batch_size, "accum": args.accum,
        "seed": args.seed, "train_rows": len(data.train["inputs"]),
        "data_tokens": data.num_tokens}))
    restored = checkpoints.restore(trainer.abstract_state(), meta)
    if restored is not None:
        state = restored[0]
        say(f"resumed from {checkpoints.dir}/{int(state['step'])}")
    else:
        has_weights = any(model_dir.glob("*.safetensors"))
        params = (load_hf(model_dir, jnp.float32, config=config)[1]
                  if has_weights and not args.scratch else init_params(config, args.seed))
        state = trainer.init(params, args.seed)

    settings = LoopSettings(args.steps, args.batch_size, args.accum, args.seed, args.eval_every,
                            args.eval_batches, args.log_every, args.time_budget, args.quiet)
    state = run_loop(trainer, state, data, settings, checkpoints, meta, out / "metrics.jsonl")
    checkpoints.close()
    export_dtype = jnp.bfloat16 if args.export_dtype == "bfloat16" else jnp.float32
    export_hf(jax.device_get(state["params"]), config, out / "export", model_dir, export_dtype)
    say(f"exported to {out / 'export'}")
    return 0


def check_seq_len(seq_len: int, config):
    if not 1 <= seq_len <= config.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} is outside 1..{config.max_position_embeddings}, "
                         "the model's context (max_position_embeddings)")


def parse_mesh(text: str) -> tuple[int, int, int]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(f"--mesh {text!r} must be three positive counts: data,tensor,expert")
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pallasite train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
