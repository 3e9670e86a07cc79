"""`pallasite` command line: generate, serve, train, quantize, plan.

`serve` and `train` define their own flags (`add_arguments` in their modules); `plan` owns its
whole command line and is imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_sampling_arguments(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the model's generation_config, else 0.8)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop")


def sampling_kwargs(args, defaults: dict | None = None) -> dict:
    """The flags given, over the model's own defaults (generation_config.json)."""
    given = {f: getattr(args, f) for f in SAMPLING_FIELDS if getattr(args, f) is not None}
    return {**(defaults or {}), **given}


def generation_defaults(folder) -> dict:
    """temperature / top_k / top_p from the checkpoint's generation_config.json when it samples."""
    import json
    from pathlib import Path
    path = Path(folder) / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    if not gen.get("do_sample", False):
        return {"temperature": 0.0} if gen else {"temperature": 0.8}
    return {k: gen[k] for k in ("temperature", "top_k", "top_p", "min_p") if gen.get(k) is not None}


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser):
    from pallasite.serving.llm import KV_CACHE_DTYPES
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="KV cache pages: 'auto' (the weights' dtype) or 'fp8' (float8 e4m3 with "
                        "per-KV-head scales: twice the pages in the same memory)")


def add_generate_arguments(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder or Hub name org/name[@revision] "
                   "(default: the embedded default model)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="stream from a running `pallasite serve` instead of loading a model")
    p.add_argument("--wait", type=float, default=300, metavar="SECONDS",
                   help="with --server: wait this long for it to finish loading (default 300)")
    p.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    from pallasite.serving.server import add_quantization_argument
    add_quantization_argument(p)
    add_kv_cache_dtype_argument(p)
    p.add_argument("--max-model-len", type=int, default=None)
    from pallasite.sharding import add_mesh_arguments
    add_mesh_arguments(p)
    add_sampling_arguments(p)
    from pallasite.serving.speculative import add_argument as add_speculative_argument
    add_speculative_argument(p)


def run_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise SystemExit("pallasite generate: the prompt is empty (give --prompt or stdin)")
    if args.server:
        from pallasite.serving.client import Client, stream_to_stdout
        try:
            with Client(args.server) as client:
                client.wait_ready(args.wait)
        except TimeoutError as e:
            raise SystemExit(f"pallasite generate: {args.server}: {e}") from None
        kwargs = sampling_kwargs(args)
        kwargs["ignore_eos"] = args.ignore_eos
        if args.chat:
            prompt = [{"role": "user", "content": prompt}]
        t0 = time.perf_counter()
        last = stream_to_stdout(args.server, prompt, kwargs)
        report(last.usage.prompt_tokens, last.usage.completion_tokens, time.perf_counter() - t0)
        return 0
    return generate_locally(prompt, args)


def generate_locally(prompt: str, args) -> int:
    import jax.numpy as jnp
    from pallasite.model import CheckpointError, ConfigError
    from pallasite.serving.llm import LLM, SamplingParams, default_model_folder
    from pallasite.model.hub import resolve
    folder = resolve(args.model) if args.model else default_model_folder()
    if args.model is None:
        print(f"pallasite: no --model given: using the embedded default model ({folder})",
              file=sys.stderr)
    kwargs = dict(max_num_seqs=1, max_num_batched_tokens=256, token_buckets=[1, 256],
                  max_model_len=args.max_model_len, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype)
    if args.speculative_config is not None:
        from pallasite.serving.speculative import check_cli
        check_cli("pallasite generate", args.speculative_config, folder)
        kwargs["speculative_config"] = args.speculative_config
        kwargs["token_buckets"] += [args.speculative_config.num_speculative_tokens + 1]
    if args.batch_invariant:
        kwargs["batch_invariant"] = True
    if args.dtype:
        kwargs["dtype"] = getattr(jnp, args.dtype)
    if args.mesh:
        from pallasite.sharding import mesh_from_args
        mesh = mesh_from_args(args)
        if mesh.devices.size > 1:  # one device needs no mesh
            kwargs["mesh"] = mesh
    try:
        sampling = SamplingParams(ignore_eos=args.ignore_eos,
                                  **sampling_kwargs(args, generation_defaults(folder)))
    except ValueError as e:
        raise SystemExit(f"pallasite generate: {e}") from None
    try:
        llm = LLM(folder, **kwargs)
    except (ConfigError, CheckpointError) as e:
        raise SystemExit(f"pallasite generate: {e}") from None
    with llm:
        if args.chat:
            if llm.tokenizer is None or not llm.tokenizer.chat_template:
                raise SystemExit("pallasite generate: --chat needs a model with a chat template")
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True)
        t0, last = time.perf_counter(), None
        try:
            for out in llm.stream(prompt, sampling):
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
                last = out
        except ValueError as e:  # a request the engine refuses: say why, no traceback
            raise SystemExit(f"pallasite generate: {e}") from None
        sys.stdout.write("\n")
        report(last.prompt_tokens, last.completion_tokens, time.perf_counter() - t0,
               last.finish_reason)
        if last.spec_proposed:
            print(f"[speculative: {last.spec_accepted} of {last.spec_proposed} proposed tokens "
                  "accepted]", file=sys.stderr)
    return 0


def report(prompt_tokens: int, completion_tokens: int, seconds: float, reason=None):
    why = f", finished: {reason}" if reason else ""
    print(f"[{prompt_tokens} prompt tokens, {completion_tokens} generated in {seconds:.2f} s: "
          f"{completion_tokens / max(seconds, 1e-9):.1f} tokens/s{why}]", file=sys.stderr)


def enable_compilation_cache():
    """Keep compiled programs on disk (`serving/settings.py`): PALLASITE_CACHE_DIR picks the
    folder, empty turns the cache off."""
    from pallasite.serving.settings import enable_compilation_cache as enable
    return enable()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pallasite", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_arguments(sub.add_parser("generate", help="complete a prompt, streaming"))
    from pallasite.serving.server import add_arguments as serve_arguments
    serve_arguments(sub.add_parser("serve", help="the gRPC generation service"))
    from pallasite.train.cli import add_arguments as train_arguments
    train_arguments(sub.add_parser("train", help="train or fine-tune a model"))
    from pallasite.tools.quantize import add_arguments as quantize_arguments
    quantize_arguments(sub.add_parser("quantize", help="write an INT4/INT8 weight-only (rtn, "
                                      "awq, gptq) or INT8 W8A8 (smoothquant) compressed-tensors "
                                      "checkpoint"))
    sub.add_parser("plan", help="rank sharding plans for a model on given GPUs (see "
                   "`pallasite plan --help`)", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # the planner owns its flags
        from pallasite.tools.plan import main as plan_main
        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "serve"):
        enable_compilation_cache()
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        from pallasite.serving.server import run
        return run(args)
    if args.command == "quantize":
        from pallasite.tools.quantize import run as quantize_run
        return quantize_run(args)
    from pallasite.train.cli import run as train_run
    return train_run(args)


if __name__ == "__main__":
    sys.exit(main())
