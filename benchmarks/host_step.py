"""Host time of an engine step at high concurrency, with the device taken out (CPU only).

`cpu_ms_per_step` (the thread's CPU time) is the figure to read on a shared machine, where
wall time includes waiting for a core. The engine drives a tiny model, but its compiled programs are replaced by stand-ins that return
a token per row at once, so what is timed is the host's own work: scheduling, packing the batch,
dispatch and accepting the sampled tokens. `--profile` prints the cProfile of the decode steps.

    python -m benchmarks.host_step --seqs 1024 [--profile] [--tokenizer]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import numpy as np


class _Out:
    """A host array that answers like a device one (copy_to_host_async, np.asarray)."""

    def __init__(self, a):
        self.a = a

    def copy_to_host_async(self):
        pass

    def __array__(self, dtype=None, copy=None):
        return self.a


def fake_device(engine, vocab: int):
    """Swap the engine's compiled forward passes and samplers for host stand-ins."""
    from pallasite.serving import sampling

    width = 2 + 2 * sampling.MAX_LOGPROBS

    def exe(params, kv, last_tokens, ints):
        return None, kv

    def compile_exe(key):
        engine._exe[key] = exe
        return exe

    def compile_sampler(S, mode):
        def sampler(logits, last_tokens, history, ints, floats):
            out = np.zeros((S, width), np.int32)
            out[:, 0] = np.arange(S) % vocab  # any token that is neither eos nor a stop
            return _Out(out), last_tokens, history
        engine._samplers[(S, mode)] = sampler
        return sampler

    engine._compile_now, engine._compile_sampler = compile_exe, compile_sampler
    engine._load = lambda history, *a: history


class _Tok:
    """Each token decodes to two characters: the detokenizer's cost without a real vocabulary."""
    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) * 2 for i in ids)


def build(seqs: int, prompt: int, output: int, tokenizer: bool):
    import jax
    from pallasite.model import config_from_dict, init_params
    from pallasite.serving.engine import Engine
    from pallasite.serving.llm import SamplingParams
    config = config_from_dict(dict(model_type="llama", vocab_size=32000, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=4096))
    params = jax.tree.map(np.asarray, init_params(config, 0))
    max_len = prompt + output + 16
    pages = seqs * -(-max_len // 16) + 16
    engine = Engine(config, params, _Tok() if tokenizer else None, num_pages=pages, page_size=16,
                    max_num_seqs=seqs, max_num_batched_tokens=max(8192, seqs),
                    max_model_len=2048, page_buckets=[128])
    fake_device(engine, 1000)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"r{i}", rng.integers(1000, 30000, prompt).tolist(), sp)
    return engine


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


def measure(engine, steps: int, profile: bool) -> dict:
    while any(s.num_computed < len(s.prompt_ids) for s in engine.seqs.values()):
        engine.step()  # prefill everything first
    for _ in range(3):
        engine.step()
    running = len(engine.scheduler.running)
    engine.totals.update(steps=0, host_s=0.0, wait_s=0.0)
    parts = {}
    for obj, name in [(engine.scheduler, "schedule"), (engine.batch, "pack"),
                      (engine, "_dispatch"), (engine, "_accept")]:
        timed(obj, name, parts)
    prof = cProfile.Profile() if profile else None
    t, cpu = time.perf_counter(), time.thread_time()
    if prof:
        prof.enable()
    per_step = []
    for _ in range(steps):
        t0 = time.thread_time()
        engine.step()
        per_step.append(time.thread_time() - t0)
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    stats = engine.stats()
    return dict(running=running, steps=steps, host_ms_per_step=stats["host_ms_per_step"],
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
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--tokenizer", action="store_true", help="detokenize every output")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    engine = build(args.seqs, args.prompt, args.output, args.tokenizer)
    rec = measure(engine, args.steps, args.profile)
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
