"""Speculative decoding: what a verify step costs, how many tokens it yields, and the speedup.

    python -m benchmarks.bench_speculative --out DIR          # GPU (H100: ~3 minutes)
    python -m benchmarks.bench_speculative --out DIR --tiny   # CPU check of the script

1. verify_cost_ratio: on the Llama-3-8B-shaped model (random bf16 weights), one engine step at
   batch 1 and context --context, verifying 1 + k tokens (k = 4), against a plain one-token
   decode step of an engine without speculation; each is the compiled forward + sampler, median
   of --iters timed calls after warm-up. Each step is also timed as forward alone and sampler
   alone, beside a third step: the plain engine on a chunk of 1 + k known tokens (bucket 8, one
   logits row), which isolates the cost of the extra query tokens from that of the extra logits
   rows and the sampler; on GPU each is profiled (device ms per category, profiling/
   step_trace.py; --no-trace skips it). Checked: the verify step's first logits row against
   the plain step's (same token, same random cache), both computed in this run (bf16 rounding
   differs between the two shapes: benchmarks/spec_identity.py tells rounding from a bug).
2. mean_accepted: the default model with its draft ("default-draft"), k = 4, greedy, on the
   beginnings of held-out documentation (the documents the training split held out: the same
   corpus, seed and split as the training recipe), tokens emitted per verify step; the outputs
   are checked token for token against decoding without speculation.
3. ngram_mean_accepted: prompt lookup (k = 4, n 1..4) on a copy-heavy workload: a document
   followed by its own first lines, so the continuation repeats text that is in the prompt.
   Mean accepted counts verify steps only; `*tokens_per_step` are the tokens over every engine
   step of the run (prefill and steps with no proposal included), for both proposers and plain
   decoding, since a proposer that proposes less often can raise the first and lower the second.
4. projected_speedup = mean_accepted / verify_cost_ratio: the batch-1 tokens a verify step
   yields on the default pair, over what that step costs on the 8B shape relative to a plain
   step (i.e. assuming the 8B target would accept as the default pair does and the draft's own
   cost is negligible; the draft's steps are measured separately in e2e).
5. e2e: the default pair's batch-1 tokens/s through LLM.generate, with and without speculation
   (token buckets 1, 1 + k and 256: verify steps in their own bucket, as the engine's default
   buckets have it).

Writes DIR/speculative.json (docs/benchmarks/speculative.json is the committed record) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.model import config_from_dict, init_params
from pallasite.serving.engine import Engine
from pallasite.serving.scheduler import Chunk, Sequence

K = 4
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny random target (CPU check)")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the cache (part 1)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts (parts 2, 5)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", default="default-draft", help="draft of the default model")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=None,
                    help="profile each step of part 1 (default: on GPU)")
    ap.add_argument("--verify-only", action="store_true",
                    help="part 1 alone: what a verify step costs, and where")
    ap.add_argument("--verify-json", default=None,
                    help="skip part 1, taking its result from this --verify-only output")
    return ap.parse_args(argv)


# -- 1. what a verify step costs ----------------------------------------------------------------
def step_inputs(engine, context: int, draft: list[int], chunk: int = 1):
    """A decoding sequence with `context` tokens in its cache (pages allocated, K/V as they
    are) and `draft` proposals, packed as the engine packs a step; with `chunk` > 1 (no
    draft) a chunk of that many known tokens ending at context - 1 + chunk instead."""
    n = context - 1 + chunk
    seq = Sequence("bench", [1 + i % 200 for i in range(n)], None)
    seq.row, seq.mode = engine_row(engine), 0  # greedy
    engine.pages.grow("bench", n + len(draft))
    table = engine.pages.tables["bench"]
    seq.num_computed, seq.slot, seq.draft = n + len(draft), 0, list(draft)
    engine.scheduler.page_table[0, :len(table)] = table
    engine.batch.admit(seq)
    packed = engine.batch.pack([Chunk(seq, context - 1, chunk + len(draft), True)])
    engine.pages.free("bench")
    engine.scheduler.page_table[0] = 0
    return packed.ints, packed.sample_ints, packed.floats, packed.key, packed.mode


def engine_row(engine):
    from pallasite.serving import sampling
    return sampling.pack_rows([dict(temperature=0.0)], 1)


def timed_step(engine, inputs, iters: int, trace_dir=None):
    """Median ms of the forward alone, the sampler alone (each waited for) and the two
    back to back (the step), the first logits row, and (with trace_dir) a profiler breakdown."""
    ints, sample_ints, floats, key, mode = inputs
    exe = engine._exe.get(key) or engine._compile_now(key)
    S = min(key[0], engine.max_num_seqs) * engine.rows
    sampler = engine._samplers.get((S, mode)) or engine._compile_sampler(S, mode)
    first, fwd, smp, both = None, [], [], []
    logits = None

    def step(parts=None):
        kv, last, hist = engine.state
        t = time.perf_counter()
        logits, kv = exe(engine.params, kv, last, ints)
        if parts is not None:
            jax.block_until_ready(logits)
            parts.append(time.perf_counter() - t)
        out, last, hist = sampler(logits, last, hist, sample_ints, floats)
        engine.state = (kv, last, hist)
        return logits, out

    for i in range(iters + 5):
        parts = []
        logits, out = step(parts)
        jax.block_until_ready(out)
        fwd.append(parts[0])
        if first is None:
            first = np.asarray(logits[0], np.float32)
    for i in range(iters + 5):  # the sampler alone, on the last logits
        kv, last, hist = engine.state
        t = time.perf_counter()
        out, last, hist = sampler(logits, last, hist, sample_ints, floats)
        jax.block_until_ready(out)
        smp.append(time.perf_counter() - t)
        engine.state = (kv, last, hist)
    for i in range(iters + 5):
        t = time.perf_counter()
        jax.block_until_ready(step()[1])
        both.append(time.perf_counter() - t)
    med = lambda xs: 1e3 * statistics.median(xs[5:])
    rec = dict(key=list(key), rows=S, forward_ms=med(fwd), sampler_ms=med(smp), step_ms=med(both))
    if trace_dir is not None:
        rec["trace"] = trace_breakdown(engine, exe, sampler, lambda: step()[1], trace_dir,
                                       rec["step_ms"])
    return rec, first


def trace_breakdown(engine, exe, sampler, step, directory, wall_ms, steps: int = 10):
    """Device time per category (profiling/step_trace.py) of `steps` pipelined steps."""
    try:
        from profiling.step_engine import trace_steps
        from profiling.step_trace import breakdown, device_ops, parse_hlo
        path = trace_steps(step, steps, str(directory))
        modules = [parse_hlo(exe.as_text(), "forward"), parse_hlo(sampler.as_text(), "sampler")]
        b = breakdown(device_ops(path), modules, steps, engine.config.vocab_size, wall_ms)
        return dict(kernel_ms=b["kernel_ms"], busy_ms=b["busy_ms"], ops_per_step=b["ops_per_step"],
                    categories={k: round(v["ms"], 4) for k, v in b["categories"].items()},
                    top=b["top"][:8])
    except Exception as e:  # a profiler problem must not cost the timings
        return dict(error=f"{type(e).__name__}: {e}")


def verify_cost(args, out: Path) -> dict:
    """Three steps on one random cache: a plain decode step (bucket 2), a plain step of a
    5-token chunk (bucket 8, one logits row: the extra query tokens alone) and the verify step
    (bucket 8, 5 logits rows, the speculative sampler): where the verify step's extra time is."""
    config = config_from_dict(TINY if args.tiny else LLAMA_8B)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    params = jax.jit(lambda: init_params(config, 0, dtype))()
    kw = dict(num_pages=args.context // 16 + 8, page_size=16, max_num_seqs=1,
              max_num_batched_tokens=8, max_model_len=args.context + 16, token_buckets=[2, 8])
    plain = Engine(config, params, **kw)
    spec = Engine(config, params, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": K}, **kw)
    # Both caches hold the same random K/V, so the first logits rows must agree.
    kv = [(jax.random.normal(jax.random.key(2 * i), k.shape, k.dtype),
           jax.random.normal(jax.random.key(2 * i + 1), v.shape, v.dtype))
          for i, (k, v) in enumerate(plain.state[0])]
    plain.state = (kv, *plain.state[1:])
    spec.state = (jax.tree.map(jnp.copy, kv), *spec.state[1:])
    trace = (lambda name: out / "traces" / name) if args.trace else (lambda name: None)
    decode, row_plain = timed_step(plain, step_inputs(plain, args.context, []), args.iters,
                                   trace("decode"))
    chunk, _ = timed_step(plain, step_inputs(plain, args.context, [], chunk=1 + K), args.iters,
                          trace("chunk"))
    verify, row_verify = timed_step(spec, step_inputs(spec, args.context, [7] * K), args.iters,
                                    trace("verify"))
    err = float(np.max(np.abs(row_plain - row_verify)) / (np.max(np.abs(row_plain)) + 1e-9))
    # The engine runs steps back to back, so the device's kernel time is what a step costs
    # there; a synced step's wall time adds the same dispatch to both. Traced: the device's.
    kernel = [r.get("trace", {}).get("kernel_ms") for r in (decode, verify)]
    ratio = kernel[1] / kernel[0] if all(kernel) else verify["step_ms"] / decode["step_ms"]
    return dict(model="tiny" if args.tiny else "llama-3-8b-shaped", dtype=str(np.dtype(dtype)),
                context=args.context, k=K, decode_ms=decode["step_ms"],
                verify_ms=verify["step_ms"], verify_cost_ratio=ratio,
                ratio_from="device kernel time" if all(kernel) else "synced step wall time",
                steps=dict(decode=decode, chunk_1_plus_k=chunk, verify=verify),
                first_row_rel_err=err,
                # bf16: the two steps' matrix shapes and split-K shares differ, so their roundings
                # do (benchmarks/spec_identity.py); float32 must agree closely.
                first_row_match=err < (1e-4 if args.tiny else 3e-2))


# -- 2, 3, 5. acceptance on the default pair ----------------------------------------------------
def held_out_documents(n: int) -> list[str]:
    """The last documents of the training order (seed 0): packed last, so in the held-out rows."""
    from pallasite.train.default_model import help_topics, stdlib_docstrings
    docs = help_topics() + stdlib_docstrings()
    order = np.random.default_rng(0).permutation(len(docs))
    return [docs[i] for i in order[-n:]]


def prompts_of(llm, docs, tokens: int) -> list[list[int]]:
    return [llm.tokenizer.encode(d)[:tokens] for d in docs]


def generate_timed(llm, prompts, max_tokens):
    from pallasite.serving.llm import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs, t = [], time.perf_counter()
    for p in prompts:  # batch 1: one request at a time
        outs.append(llm.generate([p], sp)[0].token_ids)
    return outs, time.perf_counter() - t


def acceptance(args) -> dict:
    from pallasite.serving.llm import LLM
    # The verify steps take the engine's own bucket of 1 + k tokens (its default buckets have
    # one), not the 256-token prefill bucket.
    kw = dict(max_num_seqs=1, max_num_batched_tokens=256, token_buckets=[1, K + 1, 256],
              max_model_len=1024)
    docs = held_out_documents(args.prompts)
    rec = {}
    with LLM(**kw) as plain:
        prompts = prompts_of(plain, docs, 64)
        want, t_plain = generate_timed(plain, prompts, args.max_tokens)
        plain_steps = plain.engine.stats()["steps"]
        # Copy-heavy: a document, then its first 32 tokens again; the model goes on copying.
        copy = [(p + plain.tokenizer.encode("\n\n") + p[:32])[:1024 - args.max_tokens]
                for p in prompts_of(plain, docs, 192)]
        want_copy, _ = generate_timed(plain, copy, args.max_tokens)
        copy_steps = plain.engine.stats()["steps"] - plain_steps
    n_tokens = sum(len(w) for w in want)
    rec["e2e_plain_tokens_per_s"] = n_tokens / t_plain
    # Tokens per engine step over the whole run (prefill and steps with nothing to verify
    # included): mean_accepted counts verify steps only, so a proposer that proposes less
    # often can raise it while the run takes more steps.
    n_copy = sum(len(w) for w in want_copy)
    rec.update(plain_tokens_per_step=n_tokens / plain_steps,
               plain_copy_tokens_per_step=n_copy / copy_steps)
    try:
        llm = LLM(speculative_config={"method": "draft_model", "model": args.draft,
                                      "num_speculative_tokens": K}, **kw)
    except ValueError as e:
        print(f"draft model: skipped ({e})", file=sys.stderr)
        rec["draft"] = f"skipped: {e}"
    else:
        with llm:
            got, t_spec = generate_timed(llm, prompts, args.max_tokens)
            stats = llm.engine.stats()
        rec.update(mean_accepted=stats["spec_mean_accepted"],
                   tokens_per_step=sum(len(g) for g in got) / stats["steps"],
                   draft_acceptance_rate=stats["spec_accepted_tokens"]
                   / max(stats["spec_proposed_tokens"], 1),
                   greedy_identical=got == want, e2e_spec_tokens_per_s=n_tokens / t_spec,
                   e2e_speedup=t_plain / t_spec)
    with LLM(speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 1}, **kw) as llm:
        got, _ = generate_timed(llm, copy, args.max_tokens)
        stats = llm.engine.stats()
    rec.update(ngram_mean_accepted=stats["spec_mean_accepted"],
               ngram_tokens_per_step=sum(len(g) for g in got) / stats["steps"],
               ngram_greedy_identical=got == want_copy,
               ngram_workload="a held-out document, a blank line, its first 32 tokens again")
    rec.update(prompts=len(prompts), max_tokens=args.max_tokens, k=K)
    return rec


def table(r) -> str:
    v, a = r["verify"], r["acceptance"]
    rows = [("verify step 1+4 / decode step", f"{v['verify_ms']:.3f} / {v['decode_ms']:.3f} ms",
             f"{v['verify_cost_ratio']:.3f}", "<= 1.10"),
            ("mean accepted, default + draft", f"{a.get('mean_accepted', float('nan')):.2f}",
             "identical" if a.get("greedy_identical") else "DIFFERS", ">= 2.5"),
            ("mean accepted, n-gram copy", f"{a['ngram_mean_accepted']:.2f}",
             "identical" if a["ngram_greedy_identical"] else "DIFFERS", ">= 2.0"),
            ("tokens a step, whole run: draft / n-gram / plain",
             f"{a.get('tokens_per_step', float('nan')):.2f} / {a['ngram_tokens_per_step']:.2f} / "
             f"{a['plain_tokens_per_step']:.2f}", "", "reported"),
            ("projected batch-1 speedup", f"{r.get('projected_speedup', float('nan')):.2f}x", "",
             ">= 1.8x"),
            ("e2e default pair tok/s", f"{a.get('e2e_spec_tokens_per_s', float('nan')):.0f} vs "
             f"{a['e2e_plain_tokens_per_s']:.0f} plain", "", "reported")]
    return "\n".join(f"{a:<34} {b:<26} {c:<10} {d}" for a, b, c, d in rows)


def parts_table(steps) -> str:
    """Forward / sampler / step ms of the three part-1 steps, and the traced device time per
    category where a trace was taken."""
    lines = [f"{'part 1 step':<16} {'T,P':<8} {'rows':>4} {'forward':>9} {'sampler':>9} "
             f"{'step':>9}  (ms)"]
    for name, r in steps.items():
        lines.append(f"{name:<16} {str(tuple(r['key'])):<8} {r['rows']:>4} {r['forward_ms']:>9.3f}"
                     f" {r['sampler_ms']:>9.3f} {r['step_ms']:>9.3f}")
    traced = {n: r["trace"]["categories"] for n, r in steps.items()
              if "categories" in r.get("trace", {})}
    if traced:
        cats = sorted({c for v in traced.values() for c in v})
        lines.append(f"{'device ms/step':<24}" + "".join(f"{n:>16}" for n in traced))
        for c in cats:
            lines.append(f"{c:<24}" + "".join(f"{v.get(c, 0.0):>16.4f}" for v in traced.values()))
    return "\n".join(lines)


def main(argv=None):
    args = parse(argv)
    if args.trace is None:
        args.trace = jax.default_backend() == "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d"))
    if args.verify_json:
        record["verify"] = json.loads(Path(args.verify_json).read_text())["verify"]
    else:
        record["verify"] = verify_cost(args, out)
    if not record["verify"]["first_row_match"]:
        print("the verify step's first row differs from the plain step's", file=sys.stderr)
    if args.verify_only:
        (out / "speculative_verify.json").write_text(json.dumps(record, indent=2) + "\n")
        print(parts_table(record["verify"]["steps"]))
        return 0
    record["acceptance"] = acceptance(args)
    if "mean_accepted" in record["acceptance"]:
        record["projected_speedup"] = (record["acceptance"]["mean_accepted"]
                                       / record["verify"]["verify_cost_ratio"])
    record["projected_speedup_formula"] = ("mean_accepted (default pair, tokens per verify step) "
                                           "/ verify_cost_ratio (8B-shaped, verify 1+4 vs decode)")
    (out / "speculative.json").write_text(json.dumps(record, indent=2) + "\n")
    print(table(record))
    print(parts_table(record["verify"]["steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
