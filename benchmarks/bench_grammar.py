"""Grammar engines for structured output, measured on one tokenizer: llguidance against xgrammar.

    python -m benchmarks.bench_grammar [--tokenizer FOLDER] [--tokens 64] [--out DIR]

For each schema or regex: the compile time (a fresh compiler, nothing cached) and the time to
fill one row's token bitmask, per token (median), along a random walk of allowed tokens (each
engine its own walk; EOS only when nothing else is allowed). CPU only; the default tokenizer is the embedded model's. A
missing engine is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMAS = {
    "flat_object": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{3}[0-9]{4}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}}}},
        "required": ["id", "tags", "items"]},
    "any_json_object": {"type": "object"},
}
REGEX = {"date_or_phone": r"(\d{4}-\d{2}-\d{2}|\+?[0-9 ]{7,15})"}


def llguidance_run(tok_json: str, vocab: int, eos: int, kind: str, spec, n: int, rng):
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "schema"
               else llguidance.LLMatcher.grammar_from_regex(spec))
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    mask, walk, times = allocate_token_bitmask(1, vocab), [], []
    for _ in range(n):
        t0 = time.perf_counter()
        fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
        allowed = allowed[allowed != eos] if len(allowed) > 1 else allowed
        token = int(rng.choice(allowed))
        walk.append(token)
        m.consume_token(token)
        if m.is_stopped():
            break
    return dict(tokenizer_s=tok_s, compile_s=compile_s, mask_us=1e6 * statistics.median(times),
                tokens=len(times)), walk


def xgrammar_run(folder: Path, vocab: int, eos: int, kind: str, spec, n: int, rng):
    import torch
    import transformers
    import xgrammar as xgr
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    tok_s = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = (compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
                if kind == "schema" else compiler.compile_regex(spec))
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask, times = xgr.allocate_token_bitmask(1, vocab), []
    for _ in range(n):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t0)
        bits = mask.numpy().view(np.uint8)
        allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:vocab])
        allowed = allowed[allowed != eos] if len(allowed) > 1 else allowed
        if not len(allowed) or not m.accept_token(int(rng.choice(allowed))) or m.is_terminated():
            break
    del torch
    return dict(tokenizer_s=tok_s, compile_s=compile_s, mask_us=1e6 * statistics.median(times),
                tokens=len(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="checkpoint folder with tokenizer.json (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens walked per grammar")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from pallasite.model import default_model_path
    from pallasite.model.tokenizer import Tokenizer
    folder = args.tokenizer or Path(default_model_path())
    tok = Tokenizer.from_pretrained(folder)
    vocab, eos = tok.vocab_size, tok.eos_token_ids[0]
    cases = [("schema", k, v) for k, v in SCHEMAS.items()] + [("regex", k, v) for k, v in REGEX.items()]
    rows = []
    for kind, name, spec in cases:
        row = {"case": name}
        try:
            row["llguidance"], _ = llguidance_run(tok.tok.to_str(), vocab, eos, kind, spec,
                                                  args.tokens, np.random.default_rng(0))
        except ImportError as e:
            print(f"llguidance missing ({e}): skipped")
        try:
            row["xgrammar"] = xgrammar_run(folder, vocab, eos, kind, spec, args.tokens,
                                           np.random.default_rng(0))
        except ImportError as e:
            print(f"xgrammar missing ({e}): skipped")
        rows.append(row)
    print(f"tokenizer {folder} (vocab {vocab})")
    print(f"{'case':18s} {'engine':11s} {'tokenizer ms':>12s} {'compile ms':>11s} "
          f"{'mask us/token':>14s} {'tokens':>7s}")
    for row in rows:
        for engine in ("llguidance", "xgrammar"):
            r = row.get(engine)
            if r:
                print(f"{row['case']:18s} {engine:11s} {1e3 * r['tokenizer_s']:12.1f} "
                      f"{1e3 * r['compile_s']:11.2f} {r['mask_us']:14.1f} {r['tokens']:7d}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar.json").write_text(json.dumps(
            {"tokenizer": str(folder), "vocab": vocab, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
