"""Quality of FP8 weights on the embedded default model, over documentation text it never saw.

The default model was trained on CPython 3.12's help topics and the docstrings of its standard
library, tests excluded. Held out here: the docstrings of CPython's test suite (the same
register, never in the corpus) and, further from it, numpy's function docstrings. For each
document (up to --tokens tokens) the script scores every next token with
the checkpoint's weights (bf16 values, computed in float32) and with FP8 weights, both through
W8A16 (bf16-style activations, FP8 weights: the decode path) and W8A8 (activations quantized
per token too: the prefill path on FP8 tensor cores), and reports perplexity, its change, the
mean KL divergence from the reference's next-token distribution and top-1 agreement with it. Then greedy samples with and without FP8 weights.

With `--int4 rtn,awq,gptq` the same scores for INT4 weights (group 128, or `--group-size`)
written by `pallasite quantize` with each method, calibrated on the model's own training text
(CPython's help topics: in its domain, and not the held-out text).

    python -m benchmarks.quant_quality --out /tmp/quant_quality   # CPU, about 2 minutes
    python -m benchmarks.quant_quality --out /tmp/q --int4 rtn,awq,gptq   # CPU, some minutes more
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = ["Return the number of", "The following functions are", "class Path:\n    \"\"\""]


def cpython_test_docstrings(chars: int = 6000) -> tuple[list[str], str]:
    """Docstrings of CPython's own test suite (the default model's corpus excluded `test/`
    and `idle_test/`), written as its corpus writes docstrings and joined into documents."""
    import ast
    import sys
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    entries = []
    for file in sorted((root / "test").rglob("*.py")) + sorted(
            (root / "idlelib" / "idle_test").rglob("*.py")):
        try:
            tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError):
            continue
        name = ".".join(file.relative_to(root).with_suffix("").parts)
        for node in [tree] + [n for n in ast.walk(tree) if isinstance(
                n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 200:
                entries.append(f"{name}{'.' + node.name if hasattr(node, 'name') else ''}"
                               f"\n\n{doc}")
    docs, cur = [], ""
    for e in entries:
        cur = f"{cur}\n\n{e}" if cur else e
        if len(cur) >= chars:
            docs.append(cur)
            cur = ""
    version = sys.version.split()[0]
    return docs, f"docstrings of CPython {version}'s test suite (excluded from the corpus)"


def numpy_docstrings() -> tuple[list[str], str]:
    """Docstrings of numpy's public functions: documentation in another project's style."""
    import numpy
    docs = []
    for name in sorted(dir(numpy)):
        obj = getattr(numpy, name)
        doc = getattr(obj, "__doc__", None)
        if callable(obj) and not isinstance(obj, type) and doc and len(doc) > 1500:
            docs.append(doc)
    return docs, f"docstrings of numpy {numpy.__version__} functions"


SOURCES = {"cpython-tests": cpython_test_docstrings, "numpy": numpy_docstrings}


def score(fn, params, windows):
    """Per document: (summed next-token log-likelihood, tokens, argmax per position, the top
    token's probability per position, log-probabilities [positions, vocab])."""
    out = []
    for ids in windows:
        logits = fn(params, ids[None, :-1])[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        ll = jnp.take_along_axis(logp, ids[1:, None], axis=-1).sum()
        out.append((float(ll), len(ids) - 1, np.asarray(jnp.argmax(logits, -1)),
                    np.asarray(jnp.exp(jnp.max(logp, -1))), np.asarray(logp)))
    return out


def summary(scores, ref=None) -> dict:
    ll = sum(s[0] for s in scores)
    n = sum(s[1] for s in scores)
    row = {"perplexity": float(np.exp(-ll / n)), "tokens": n}
    if ref is not None:
        same = sum(int((a[2] == b[2]).sum()) for a, b in zip(scores, ref))
        row["top1_agreement"] = same / n
        sure = [b[3] >= 0.5 for b in ref]  # where the reference's top token has p >= 0.5
        row["top1_agreement_where_ref_p_ge_0.5"] = sum(
            int((a[2] == b[2])[m].sum()) for a, b, m in zip(scores, ref, sure)) / max(
            1, sum(int(m.sum()) for m in sure))
        row["perplexity_change"] = row["perplexity"] / summary(ref)["perplexity"] - 1
        # KL(reference || this) per token: the whole distribution's change, which the
        # perplexity of a text averages away
        row["kl_divergence"] = sum(float(np.sum(np.exp(b[4]) * (b[4] - a[4])))
                                   for a, b in zip(scores, ref)) / n
    return row


def int4_params(folder, methods, workdir: Path, samples: int = 16, seq_len: int = 512,
                group_size: int = 128) -> dict:
    """method -> params of the INT4 folder `pallasite quantize` writes with it, calibrated on
    the model's own help topics. A method may name options to turn off after a colon, joined
    by `+` (`gptq:no-act-order+no-sequential`)."""
    from pallasite.model import load_hf
    from pallasite.tools import quantize as q
    from pallasite.train.default_model import help_topics
    text = "\n\n".join(help_topics())
    out = {}
    for spec in methods:
        method, _, off = spec.partition(":")
        options = {o.removeprefix("no-").replace("-", "_"): False for o in off.split("+") if o}
        q.quantize(folder, workdir / spec, method=method, bits=4, group_size=group_size,
                   text=text, samples=samples, seq_len=seq_len, progress=False, **options)
        out[spec] = load_hf(workdir / spec, dtype=jnp.float32)[1]
    return out


def greedy(fn, params, tokenizer, prompt: str, n: int, width: int = 96) -> str:
    ids = tokenizer.encode(prompt)
    start = len(ids)
    for _ in range(n):
        buf = np.zeros((1, width), np.int32)
        buf[0, :len(ids)] = ids[-width:]
        ids.append(int(np.argmax(fn(params, buf)[0, min(len(ids), width) - 1])))
    return tokenizer.decode(ids[start:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/quant_quality")
    p.add_argument("--docs", type=int, default=16, help="documents per source")
    p.add_argument("--sources", default="cpython-tests,numpy", help=", ".join(SOURCES))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--sample-tokens", type=int, default=40)
    p.add_argument("--int4", default="", help="also INT4 weights by these `pallasite "
                   "quantize` methods (comma-separated: rtn, awq, gptq; options turned off "
                   "after a colon, joined by +: gptq:no-act-order+no-sequential)")
    p.add_argument("--group-size", type=int, default=128, help="INT4 rows a scale (-1: channel)")
    args = p.parse_args(argv)
    from pallasite.model import default_model_path, forward_logits, load_hf, quant
    from pallasite.model.tokenizer import Tokenizer
    folder = default_model_path()
    config, params = load_hf(folder, dtype=jnp.float32)
    qparams = quant.quantize_params(params)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    tokenizer = Tokenizer.from_pretrained(folder)

    def forward(mode):
        jitted = jax.jit(lambda p, ids: forward_logits(p, config, ids))

        def call(p, ids):  # the path is read from the environment while tracing
            os.environ["PALLASITE_QUANT_MATMUL"] = mode
            return jitted(p, ids)
        return call

    t0 = time.time()
    int4 = int4_params(folder, args.int4.split(","), Path(args.out) / "int4",
                       group_size=args.group_size) if args.int4 else {}
    fns = {mode: forward(mode) for mode in ("w8a16", "w8a8")}
    results, sources = {}, {}
    group = "channel" if args.group_size == -1 else f"g{args.group_size}"
    for key in args.sources.split(","):
        texts, sources[key] = SOURCES[key]()
        windows = [np.asarray(tokenizer.encode(t)[:args.tokens], np.int32) for t in texts]
        # One shape (one compile per path); documents spread over the whole set.
        windows = [w for w in windows if len(w) == args.tokens]
        windows = windows[::max(1, len(windows) // args.docs)][:args.docs]
        ref = score(fns["w8a16"], params, windows)
        results[key] = {"documents": len(windows),
                        "reference (bf16 weights, f32 math)": summary(ref),
                        # the noise floor: the same weights, computed in bf16
                        "bf16 weights, bf16 math": summary(score(fns["w8a16"], bf16, windows),
                                                           ref)}
        for mode in ("w8a16", "w8a8"):
            results[key][f"fp8 weights, {mode}"] = summary(score(fns[mode], qparams, windows),
                                                           ref)
        for method, p4 in int4.items():
            results[key][f"int4 {group} weights, {method}"] = summary(
                score(fns["w8a16"], p4, windows), ref)
    os.environ.pop("PALLASITE_QUANT_MATMUL")
    samples = []
    for prompt in PROMPTS:
        samples.append({"prompt": prompt,
                        "reference": greedy(fns["w8a16"], params, tokenizer, prompt,
                                            args.sample_tokens),
                        "fp8_w8a16": greedy(fns["w8a16"], qparams, tokenizer, prompt,
                                            args.sample_tokens)})
    record = {"model": "embedded default model", "held_out": sources,
              "tokens_per_document": args.tokens, "results": results, "greedy": samples,
              "weight_bytes": {"reference_bf16": quant.weight_bytes(params) // 2,
                               "fp8": quant.weight_bytes(qparams),
                               **{f"int4_{m}": quant.weight_bytes(p4) for m, p4 in int4.items()}},
              "int4_calibration": "CPython's help topics (the training text), 16 x 512 tokens"
              if int4 else None, "int4_group_size": args.group_size if int4 else None,
              "jax_version": jax.__version__, "backend": jax.default_backend(),
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_quality.json").write_text(json.dumps(record, indent=1))
    print(f"{'text':14s} {'weights':40s} {'perplexity':>10s} {'change':>8s} {'KL':>7s}"
          f" {'top-1 agree':>11s} {'(ref p>=.5)':>11s}")
    for key, rows in results.items():
        for name, r in rows.items():
            if name == "documents":
                continue
            change = f"{r['perplexity_change']:+.2%}" if "perplexity_change" in r else ""
            agree = f"{r['top1_agreement']:.2%}" if "top1_agreement" in r else ""
            sure = f"{r['top1_agreement_where_ref_p_ge_0.5']:.2%}" if agree else ""
            kl = f"{r['kl_divergence']:.4f}" if agree else ""
            print(f"{key:14s} {name:40s} {r['perplexity']:10.3f} {change:>8s} {kl:>7s}"
                  f" {agree:>11s} {sure:>11s}")
    for s in samples:
        print(f"\n--- {s['prompt']!r}\nreference: {s['reference']!r}\nfp8:       {s['fp8_w8a16']!r}")
    print(f"\nwrote {out / 'quant_quality.json'}")


if __name__ == "__main__":
    main()
