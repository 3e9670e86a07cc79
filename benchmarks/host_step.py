"""Host time of an engine step at high concurrency, with the device taken out (CPU only).

`cpu_ms_per_step` (the thread's CPU time) is the figure to read on a shared machine, where
wall time includes waiting for a core. The engine drives a tiny model, but its compiled
programs are replaced by stand-ins that return a token per row at once, so what is timed is the
host's own work: scheduling, packing the batch, dispatch and accepting the sampled tokens.
`--profile` prints the cProfile of the timed steps. `--tokenizer` adds the embedded default
model's tokenizer: each step's outputs then get their text after the step as `EngineLoop` makes
it (the `fill` part), streamed a step at a time, or with `--whole-text` only at each request's
end, as `LLM.generate` takes it. `--quiet` (or `--final-only`) asks for each request's first
and last outputs only, as `LLM.generate` and the servers' unary calls do (`Engine.add_request`):
a step then makes outputs for the finished and the newly started alone.
`--device-ms` gives the stand-in device a time a step, overlapped with the host's work as on a
GPU. `--launch-ms` gives each forward call a time without the GIL, as a GPU's launch spends in
XLA's runtime, and `--launch-thread` makes those calls on the engine's launch thread
(`serving/launcher.py`), beside the accepting of the step before.

Two cases, both by default: pure decode (`--decode`), where every sequence decodes through the
timed steps, and `--mixed`, where outputs are short (uniform in [8, 2 * --churn_output]) and
finished requests are replaced by new prompts, so each step carries ~1024 decode rows plus the
prefill chunks of the newly admitted ones (the churn of a ShareGPT run). Each prints a line
(`host_ms_per_step`: the engine's own mean host time a step, garbage collections included; then
the CPU time's median and best step, and the median of each part), then its JSON record.
The garbage collector is set as warm-up leaves it (`--default_gc`: Python's defaults).

    python -m benchmarks.host_step --seqs 1024 [--decode | --mixed] [--profile] [--tokenizer]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from operator import attrgetter

import numpy as np

from pallasite.serving.detokenize import whole_text


class _Out:
    """A host array that answers like a device one (copy_to_host_async, np.asarray): reading it
    waits until `ready` (perf_counter seconds), when the stand-in device has finished it."""

    def __init__(self, a, ready=0.0):
        self.a, self.ready = a, ready

    def copy_to_host_async(self):
        pass

    def __array__(self, dtype=None, copy=None):
        if (wait := self.ready - time.perf_counter()) > 0:
            time.sleep(wait)
        return self.a


def fake_device(engine, vocab: int, draw=None, device_ms: float = 0.0, launch_ms: float = 0.0):
    """Swap the engine's compiled forward passes and samplers for host stand-ins. `draw(ints,
    S)` gives each row's token from the sampler's int inputs (default: any token that is neither
    eos nor a stop); its logprob is -0.5 and its top logprob ids are itself. `device_ms`: each
    step's tokens come that long after the stand-in device, which runs steps one at a time in
    launch order, starts it. `launch_ms`: each forward call takes that long without the GIL
    (a sleep), as a GPU's launch spends its time in XLA's runtime."""
    from pallasite.serving import sampling

    width = 2 + 2 * sampling.MAX_LOGPROBS
    free = [0.0]  # when the stand-in device finishes the last step launched

    def exe(params, kv, last_tokens, ints, *logits):
        if launch_ms:
            time.sleep(launch_ms / 1e3)
        return (logits or (None,))[0], kv

    def compile_exe(key):
        engine._exe[key] = exe
        return exe

    def compile_sampler(S, mode):
        def sampler(logits, last_tokens, history, ints, floats):
            out = np.zeros((S, width), np.int32)
            out[:, 0] = np.arange(S) % vocab if draw is None else draw(ints, S)
            out[:, 1] = np.float32(-0.5).view(np.int32)
            out[:, 2:2 + sampling.MAX_LOGPROBS] = out[:, :1]
            free[0] = max(free[0], time.perf_counter()) + device_ms / 1e3
            return _Out(out, free[0]), last_tokens, history
        engine._samplers[(S, mode)] = sampler
        return sampler

    engine._compile_now, engine._compile_sampler = compile_exe, compile_sampler
    engine._load = lambda history, *a: history


def stand_in_engine(tokenizer=None, device_ms: float = 0.0, launch_ms: float = 0.0,
                    **engine_kwargs):
    """An engine of a one-layer model (contexts up to 2048, pages of 16) whose compiled programs
    are `fake_device`'s stand-ins; `engine_kwargs` size it."""
    import jax
    from pallasite.model import config_from_dict, init_params
    from pallasite.serving.engine import Engine
    config = config_from_dict(dict(model_type="llama", vocab_size=32000, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=4096))
    params = jax.tree.map(np.asarray, init_params(config, 0))
    engine = Engine(config, params, tokenizer, page_size=16, max_model_len=2048,
                    page_buckets=[128], **engine_kwargs)
    fake_device(engine, 1000, device_ms=device_ms, launch_ms=launch_ms)
    return engine


def build(seqs: int, prompt: int, output: int, tokenizer: bool, mixed: bool = False,
          settle: bool = True, whole_text: bool = False, device_ms: float = 0.0,
          slots: int | None = None, launch_ms: float = 0.0, launch_thread: bool = False,
          quiet: bool = False):
    from pallasite.serving.detokenize import TextStage
    from pallasite.serving.llm import SamplingParams
    from pallasite.serving.warmup import settle_heap
    max_len = prompt + output + 16
    slots = slots or seqs
    pages = max(slots * -(-max_len // 16), 2048 // 16) + 16  # room for max_model_len too
    tok = None
    if tokenizer:
        from pallasite.model import default_model_path
        from pallasite.model.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(default_model_path())
    engine = stand_in_engine(tok, device_ms, launch_ms, num_pages=pages, max_num_seqs=slots,
                             max_num_batched_tokens=max(8192, slots),
                             launch_thread=launch_thread)
    if settle:
        settle_heap()  # as warm-up leaves the collector
    rng = np.random.default_rng(0)
    engine.arrivals = iter(range(1 << 30))
    engine.text = TextStage(tok) if tok else None
    engine.whole = {} if tok and whole_text else None  # request -> (prompt, tokens so far)

    def add():
        n = int(rng.integers(8, 2 * output + 1)) if mixed else output
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        name, ids = f"r{next(engine.arrivals)}", rng.integers(100, 4000, prompt).tolist()
        engine.add_request(name, ids, sp, quiet)
        if engine.whole is not None:
            engine.whole[name] = (ids, [])
        elif engine.text:
            engine.text.start(name, ids)
    engine.add = add
    for _ in range(seqs):
        add()
    return engine


def step(engine, mixed: bool):
    """One engine step; in mixed mode each finished request is replaced by a new one."""
    outputs = engine.step()
    if engine.text:
        outputs = engine.text.fill(outputs)
    if engine.whole is not None:  # as LLM.generate takes it: tokens a step, text at the end
        for out in outputs:
            prompt, tokens = engine.whole[out.request_id]
            tokens += out.new_token_ids
            if out.finished:
                whole_text(engine.tokenizer, prompt, tokens, out.stop_reason)
                del engine.whole[out.request_id]
    for _ in range(sum(map(attrgetter("finished"), outputs)) if mixed else 0):
        engine.add()


def python_loop_ms() -> float:
    """CPU time of a fixed pure-Python loop (1M additions): the scale of this host's Python,
    to compare host figures taken on different machines."""
    best = float("inf")
    for _ in range(3):
        t, x = time.thread_time(), 0
        for i in range(1_000_000):
            x += i
        best = min(best, time.thread_time() - t)
    return 1e3 * best


def timed(obj, name: str, into: dict):
    """Wrap a method so each call's CPU time is listed in into[name]."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            into.setdefault(name, []).append(time.thread_time() - t)
    setattr(obj, name, wrapper)


def measure(engine, steps: int, profile: bool, mixed: bool = False) -> dict:
    first = list(engine.seqs.values())
    while any(s.status == "waiting" or (s.status == "running" and s.num_computed < len(
            s.prompt_ids)) for s in first):
        step(engine, mixed)  # prefill everything first
    for _ in range(3 if not mixed else 40):  # mixed: until requests finish and new ones come
        step(engine, mixed)
    running = len(engine.scheduler.running)
    engine.totals.update(steps=0, host_s=0.0, wait_s=0.0)
    parts = {}
    schedule = "schedule_step" if hasattr(engine.scheduler, "schedule_step") else "schedule"
    for obj, name in [(engine.scheduler, schedule), (engine.batch, "pack"),
                      (engine, "_dispatch"), (engine, "_accept")] + (
                          [(engine.text, "fill")] if engine.text else []):
        timed(obj, name, parts)
    prof = cProfile.Profile() if profile else None
    t, cpu = time.perf_counter(), time.thread_time()
    if prof:
        prof.enable()
    per_step, tokens = [], 0
    engine.step_log = []
    for _ in range(steps):
        t0 = time.thread_time()
        step(engine, mixed)
        per_step.append(time.thread_time() - t0)
    tokens = [e["tokens"] for e in engine.step_log]
    engine.step_log = None
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    stats = engine.stats()
    return dict(mode="mixed" if mixed else "decode", running=running, steps=steps,
                tokens_per_step=float(np.mean(tokens)), host_ms_per_step=stats["host_ms_per_step"],
                wall_ms_per_step=1e3 * wall / steps, cpu_ms_per_step=1e3 * cpu / steps,
                cpu_ms_median=1e3 * float(np.median(per_step)),
                cpu_ms_best=1e3 * float(np.min(per_step)),
                **{f"{k.strip('_')}_cpu_ms_median": 1e3 * float(np.median(v))
                   for k, v in parts.items()},
                python_loop_ms=python_loop_ms())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--output", type=int, default=400)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--slots", type=int, default=None,
                    help="the engine's sequence limit (default: --seqs), e.g. 1024 slots with a "
                         "few running, as at the end of an offline run")
    ap.add_argument("--tokenizer", action="store_true",
                    help="detokenize the outputs (the default model's tokenizer)")
    ap.add_argument("--whole-text", action="store_true",
                    help="with --tokenizer: each request's text only at its end")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="the stand-in device's time a step (steps overlap the host's work as "
                         "on a GPU; wall_ms_per_step then shows what the host adds)")
    ap.add_argument("--launch-ms", type=float, default=0.0,
                    help="each forward call's time without the GIL (a GPU's launch)")
    ap.add_argument("--launch-thread", action="store_true",
                    help="launch each step on the engine's launch thread (as on a GPU)")
    ap.add_argument("--quiet", "--final-only", action="store_true", dest="quiet",
                    help="each request's first and last outputs only, as LLM.generate asks")
    ap.add_argument("--decode", action="store_true", help="only the pure decode case")
    ap.add_argument("--mixed", action="store_true", help="only the case where requests finish "
                    "and new ones arrive")
    ap.add_argument("--churn_output", type=int, default=64,
                    help="--mixed: mean output tokens of a request")
    ap.add_argument("--default_gc", action="store_true",
                    help="Python's collector thresholds, not those warm-up sets")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    recs = []
    for mixed in [False, True] if args.decode == args.mixed else [args.mixed]:
        engine = build(args.seqs, args.prompt, args.churn_output if mixed else args.output,
                       args.tokenizer, mixed, settle=not args.default_gc,
                       whole_text=args.whole_text, device_ms=args.device_ms, slots=args.slots,
                       launch_ms=args.launch_ms, launch_thread=args.launch_thread,
                       quiet=args.quiet)
        rec = dict(measure(engine, args.steps, args.profile, mixed), quiet=args.quiet)
        parts = " ".join(f"{k[:-len('_cpu_ms_median')]} {v:.2f}" for k, v in rec.items()
                         if k.endswith("_cpu_ms_median"))
        print(f"{rec['mode']:>6}: host {rec['host_ms_per_step']:.2f} ms/step at "
              f"{rec['running']} running ({rec['tokens_per_step']:.0f} tokens a step); wall "
              f"{rec['wall_ms_per_step']:.2f} (device {args.device_ms:g}); CPU median "
              f"{rec['cpu_ms_median']:.2f}, best {rec['cpu_ms_best']:.2f}; parts (median ms): "
              f"{parts}; python loop "
              f"{rec['python_loop_ms']:.0f} ms", flush=True)
        print(json.dumps(rec), flush=True)
        recs.append(rec)
        del engine
    return recs


if __name__ == "__main__":
    main()
