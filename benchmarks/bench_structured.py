"""Structured output's cost: a decode step with every row JSON-schema-constrained against the same
step unconstrained, batch 64, on a Llama-3-8B-shaped model (random bf16 weights made on the
device). Target: constrained_step_ratio <= 1.10.

    python -m benchmarks.bench_structured --out DIR            # GPU, about 2 minutes
    python -m benchmarks.bench_structured --tiny --out DIR     # a tiny model: CPU dry run

First a check of the guided sampler against a numpy reference on fresh random logits and
bitmasks (output poisoned first). Then two runs of the same workload on one engine: 64 requests
(random 128-token prompts, `--tokens` outputs, EOS ignored), free, then each constrained by a JSON
schema of one string field of at least 4000 characters (so that no row finishes early). A step's time is the gap between consecutive steps' results
(so it includes the host's work that the device waits for: a constrained row's mask needs its
previous token, so those steps do not run ahead; see serving/structured.py). Only steps with all
64 rows decoding count. The grammars use `--tokenizer` (default: the embedded model's, padded to
the model's vocabulary: its masks cost less than a 128k-token tokenizer's would; pass a real
Llama-3 tokenizer folder where there is one). Writes OUT/structured.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# The string must be long, so no row can close the object (and stop) before --tokens: a step
# with every row decoding needs every row still running.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}},
          "required": ["text"]}
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def check_sampler(vocab: int, rows: int = 64) -> float:
    """The guided greedy sampler against numpy: masked, biased argmax. Returns the max error."""
    from pallasite.serving import sampling
    rng = np.random.default_rng(int(time.time()))
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    words = (vocab + 31) // 32
    mask = rng.integers(-2**31, 2**31 - 1, (rows, words), dtype=np.int64).astype(np.int32)
    mask[0] = 0
    mask[0, 0] = 1 << 5  # a row allowing a single token
    ids = rng.integers(0, vocab, (rows, 300)).astype(np.int32)
    vals = np.where(rng.random((rows, 300)) < 0.1, rng.normal(0, 5, (rows, 300)), 0).astype(np.float32)
    floats, ints = sampling.pack_rows([{}] * rows, rows)
    guide = sampling.Guide(jnp.asarray(mask), jnp.asarray(ids), jnp.asarray(vals))
    out = jnp.full((rows,), -7, jnp.int32)  # poisoned
    out = jax.jit(lambda l, g: sampling.sample(l, sampling.Rows.from_packed(floats, ints),
                                               sampling.init_history(rows, vocab), "greedy", g)[0]
                  )(jnp.asarray(logits), guide)
    ref = logits.copy()
    np.add.at(ref, (np.arange(rows)[:, None], ids), vals)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    ref = np.where(bits == 1, ref, -np.inf).argmax(-1)
    bad = int(np.sum(np.asarray(out) != ref))
    if bad:
        raise AssertionError(f"guided sampler: {bad} of {rows} rows differ from the reference")
    return 0.0


def make_engine(config, params, tokenizer, rows: int, prompt: int, tokens: int, tiny: bool):
    from pallasite.serving.engine import Engine
    from pallasite.serving.structured import Guide
    page = 16
    max_len = prompt + tokens + page
    per_seq = -(-max_len // page)
    budget = 256 if tiny else 512
    engine = Engine(config, params, None, num_pages=rows * per_seq + 8, page_size=page,
                    max_num_seqs=rows, max_num_batched_tokens=budget, max_model_len=max_len,
                    token_buckets=[rows, budget], page_buckets=[per_seq])
    # Random weights have no tokenizer: the grammars get one, the engine detokenizes nothing.
    engine.guide = Guide(tokenizer, config.vocab_size, tokenizer.eos_token_ids)
    return engine.warmup()


def decode_steps(engine, rows: int, prompt: int, tokens: int, constrained: bool, seed: int):
    from pallasite.serving.llm import SamplingParams
    from pallasite.serving.structured import StructuredOutput
    rng = np.random.default_rng(seed)
    so = StructuredOutput(json_schema=SCHEMA) if constrained else None
    for i in range(rows):
        ids = rng.integers(0, engine.config.vocab_size, prompt).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                        ignore_eos=True, structured_output=so))
    engine.step_log = []
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    log, engine.step_log = engine.step_log, None
    times = [b["done"] - a["done"] for a, b in zip(log, log[1:])
             if "done" in a and "done" in b and b["decode_rows"] == rows == b["rows"]]
    finished = {o.request_id: o.finish_reason for o in outs if o.finished}
    return times, finished


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry run)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="folder with tokenizer.json for the grammars (default: embedded model's)")
    args = ap.parse_args(argv)
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise SystemExit("llguidance is not installed here: structured output (and this "
                         "benchmark) need it; pip install llguidance") from None
    from pallasite.model import config_from_dict, default_model_path, init_params
    from pallasite.model.tokenizer import Tokenizer
    env = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(json.dumps(env), flush=True)
    shape = TINY if args.tiny else LLAMA3_8B
    config = config_from_dict(dict(model_type="llama", **shape))
    check_sampler(config.vocab_size)
    print("guided sampler matches the numpy reference", flush=True)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    params = jax.jit(lambda: init_params(config, 0, dtype))()
    tokenizer = Tokenizer.from_pretrained(args.tokenizer or default_model_path())
    engine = make_engine(config, params, tokenizer, args.rows, args.prompt, args.tokens, args.tiny)
    t0 = time.perf_counter()
    free, _ = decode_steps(engine, args.rows, args.prompt, args.tokens, False, 1)
    guided, finished = decode_steps(engine, args.rows, args.prompt, args.tokens, True, 2)
    if not free or not guided:
        raise SystemExit("no step had every row decoding: raise --tokens")
    record = dict(**env, model="tiny" if args.tiny else "llama3-8b-shaped", rows=args.rows,
                  prompt=args.prompt, tokens=args.tokens, schema=SCHEMA,
                  tokenizer=str(args.tokenizer or "embedded default (4096 tokens)"),
                  free_step_ms=1e3 * statistics.median(free), free_steps=len(free),
                  constrained_step_ms=1e3 * statistics.median(guided),
                  constrained_steps=len(guided),
                  constrained_finished_stop=sum(r == "stop" for r in finished.values()),
                  seconds=time.perf_counter() - t0)
    record["constrained_step_ratio"] = record["constrained_step_ms"] / record["free_step_ms"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "structured.json").write_text(json.dumps(record, indent=1))
    print(f"{'batch':>5s} {'free ms/step':>13s} {'constrained ms/step':>20s} {'ratio':>6s} "
          f"(target <= 1.10)")
    print(f"{args.rows:5d} {record['free_step_ms']:13.2f} {record['constrained_step_ms']:20.2f} "
          f"{record['constrained_step_ratio']:6.2f}")


if __name__ == "__main__":
    main()
