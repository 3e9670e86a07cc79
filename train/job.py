"""One `pallasite train` job: data, state (fresh or resumed), the loop, the export."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from ..model import CheckpointError, ConfigError, init_params, load_config, load_hf, to_hf_dict
from ..model.tokenizer import Tokenizer, TokenizerError
from .checkpoint import Checkpoints, ResumeError
from .data import DataError, build_dataset
from .export import ExportError, export_hf
from .loop import LoopSettings, run_loop
from .mesh import make_mesh
from .step import Distill, Hyper, Trainer


class UsageError(ValueError):
    """Settings that cannot work: a sequence longer than the context, a bad mesh, ..."""


def check_seq_len(seq_len: int, config):
    if not 1 <= seq_len <= config.max_position_embeddings:
        raise UsageError(f"--seq-len {seq_len} is outside 1..{config.max_position_embeddings}, "
                         "the model's context (max_position_embeddings)")


def parse_mesh(text: str) -> tuple[int, int, int]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise UsageError(f"--mesh {text!r} must be three positive counts: data,tensor,expert")
    return sizes


# Errors a user causes; `pallasite train` prints these as one line instead of a traceback.
USER_ERRORS = (UsageError, DataError, ConfigError, CheckpointError, TokenizerError, ResumeError,
               ExportError)


def load_data(args, say):
    model_dir = Path(args.model)
    config = load_config(model_dir)
    args.seq_len = args.seq_len or min(config.max_position_embeddings, 1024)
    check_seq_len(args.seq_len, config)
    if not config.eos_token_ids:
        raise DataError(f"{model_dir}/config.json has no eos_token_id to end documents with")
    # Documents are tokenized exactly as the server tokenizes a prompt (BOS included or not).
    tokenizer = Tokenizer.from_pretrained(model_dir)
    data = build_dataset(args.data, tokenizer.encode, config.eos_token_ids[0], args.seq_len,
                         args.seed, args.eval_fraction, args.train_extra or ())
    say(f"data: {data.num_docs} documents, {data.num_tokens} tokens, {len(data.train['inputs'])} "
        f"train / {len(data.eval['inputs'])} eval rows of {args.seq_len}")
    if args.epochs:
        rows_per_step = args.batch_size * args.accum
        args.steps = max(1, round(args.epochs * len(data.train["inputs"]) / rows_per_step))
    return config, data


def make_trainer(args, config) -> Trainer:
    dtype = {"auto": jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32,
             "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    hyper = Hyper(args.lr, args.min_lr_ratio, args.warmup, args.steps, args.weight_decay,
                  clip=args.clip)
    data, tensor, expert = parse_mesh(args.mesh)
    if data * tensor * expert > len(jax.devices()):
        raise UsageError(f"--mesh {args.mesh} needs {data * tensor * expert} devices; "
                         f"{len(jax.devices())} available")
    if args.batch_size % data:
        raise UsageError(f"--batch-size {args.batch_size} does not divide over the {data} "
                         "data-parallel devices of --mesh")
    mesh = make_mesh(data, tensor, expert)
    distill, teacher = teacher_of(args, config)
    return Trainer(config, hyper, mesh, dtype, distill, teacher)


def teacher_of(args, config):
    """(Distill, the teacher's params) for --teacher, or (None, None)."""
    if not getattr(args, "teacher", None):
        return None, None
    if not 0.0 <= args.distill_weight <= 1.0:
        raise UsageError(f"--distill-weight {args.distill_weight} is outside 0..1")
    if args.distill_temperature <= 0:
        raise UsageError(f"--distill-temperature {args.distill_temperature} must be > 0")
    folder = Path(args.teacher)
    if not any(folder.glob("*.safetensors")):
        raise UsageError(f"--teacher {folder}: no weights (*.safetensors) there")
    t_config = load_config(folder)  # checked before any weight is read
    if t_config.vocab_size != config.vocab_size:
        raise UsageError(f"--teacher's vocabulary ({t_config.vocab_size} tokens) differs from "
                         f"the model's ({config.vocab_size} tokens)")
    t_config, params = load_hf(folder, config=t_config)
    return Distill(t_config, args.distill_weight, args.distill_temperature), params


def start_state(args, trainer: Trainer, checkpoints: Checkpoints | None, meta: dict, say):
    """The latest checkpoint's state if there is one, else fresh: the model folder's weights
    (unless --scratch or it has none) or a random init."""
    restored = checkpoints.restore(trainer.abstract_state(), meta) if checkpoints else None
    if restored is not None:
        state = restored[0]
        say(f"resumed from {checkpoints.dir}/{int(state['step'])}")
        return state
    model_dir = Path(args.model)
    if any(model_dir.glob("*.safetensors")) and not args.scratch:
        params = load_hf(model_dir, jnp.float32, config=trainer.config)[1]
    else:
        params = init_params(trainer.config, args.seed)
    return trainer.init(params, args.seed)


def train(args):
    # Training differentiates through attention; the jnp reference has gradients everywhere.
    os.environ.setdefault("PALLASITE_ATTENTION_IMPL", "reference")
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    out = Path(args.out)
    config, data = load_data(args, say)
    out.mkdir(parents=True, exist_ok=True)
    trainer = make_trainer(args, config)
    checkpoints = (Checkpoints(out / "checkpoints", args.save_every, args.keep)
                   if args.save_every > 0 else None)
    # What a resumed run must share with the checkpoint (JSON-normalized, as restored).
    meta = json.loads(json.dumps({
        "model": to_hf_dict(config), "hyper": dataclasses.asdict(trainer.hyper),
        "seq_len": args.seq_len, "batch_size": args.batch_size, "accum": args.accum,
        "seed": args.seed, "train_rows": len(data.train["inputs"]),
        "data_tokens": data.num_tokens,
        **({"teacher": str(args.teacher), "distill_weight": args.distill_weight,
            "distill_temperature": args.distill_temperature}
           if getattr(args, "teacher", None) else {})}))
    state = start_state(args, trainer, checkpoints, meta, say)

    best = {"eval_loss": float("inf"), "params": None}

    def keep_best(step, state, result):
        if args.export_best and result["eval_loss"] < best["eval_loss"]:
            best.update(result, step=step, params=jax.device_get(state["params"]))

    settings = LoopSettings(args.steps, args.batch_size, args.accum, args.seed, args.eval_every,
                            args.eval_batches, args.log_every, args.time_budget, args.quiet)
    state = run_loop(trainer, state, data, settings, checkpoints, meta, out / "metrics.jsonl",
                     keep_best)
    if checkpoints:
        checkpoints.close()
    params = jax.device_get(state["params"]) if best["params"] is None else best["params"]
    export_dtype = jnp.bfloat16 if args.export_dtype == "bfloat16" else jnp.float32
    export_hf(params, config, out / "export", args.model, export_dtype)
    which = "last step" if best["params"] is None else f"step {best['step']} (best held-out loss)"
    say(f"exported the params of the {which} to {out / 'export'}")
