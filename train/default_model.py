"""Train the embedded default model: a small Llama on Python's own documentation text.

Corpus (PSF license, shipped with every CPython): the interactive help topics in
`pydoc_data/topics.py` (one document per topic) and the docstrings of the standard library's
modules, classes and functions (tests excluded), each headed by its dotted name. It is built from
the running interpreter, so it depends only on the Python version.

    python -m pallasite.train.default_model --out /tmp/default_run   # GPU: the real run
    python -m pallasite.train.default_model --out /tmp/smoke --smoke   # CPU: a tiny end-to-end check

Writes OUT/export (the Hugging Face folder), OUT/metrics.jsonl, OUT/samples.txt,
OUT/loss.png and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import time
from pathlib import Path

SKIP_PARTS = {"site-packages", "test", "tests", "idle_test"}
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "model" / "default_model"


def help_topics() -> list[str]:
    import pydoc_data.topics
    return [text for _, text in sorted(pydoc_data.topics.topics.items())]


def stdlib_docstrings(min_chars: int = 40) -> list[str]:
    """'module.Class.method' + blank line + docstring, for each documented definition."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, seen = [], set()
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root).with_suffix("").parts
        if SKIP_PARTS & set(parts) or parts[0].startswith("test"):
            continue
        try:
            tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError):
            continue
        module = ".".join(p for p in parts if p != "__init__")
        for name, doc in _docstrings(tree, module):
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                docs.append(f"{name}\n\n{doc}")
    return docs


def _docstrings(node, name):
    doc = ast.get_docstring(node)
    if doc:
        yield name, doc
    for child in node.body:
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if not child.name.startswith("_") or child.name == "__init__":
                yield from _docstrings(child, f"{name}.{child.name}")


def write_corpus(path: Path) -> dict:
    topics, docstrings = help_topics(), stdlib_docstrings()
    with open(path, "w") as f:
        for text in topics + docstrings:
            f.write(json.dumps({"text": text}) + "\n")
    return {"python": sys.version.split()[0], "topics": len(topics),
            "docstrings": len(docstrings),
            "chars": sum(map(len, topics)) + sum(map(len, docstrings))}


# The default model: Llama architecture, ~21M params (42 MB in bf16), head_dim 64 for the kernels.
MODEL = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=512,
             intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
SMOKE_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
PROMPTS = ["The for statement", "A list comprehension", "json.dumps\n\n", "Raise",
           "The import system", "os.path.join\n\n"]


def make_model_dir(path: Path, tokenizer_dir: Path, corpus: Path, smoke: bool) -> Path:
    """config.json + tokenizer files: the project's default tokenizer when there is one (with its
    BOS/EOS choices), else a byte-level BPE of 4096 tokens trained here on the corpus."""
    import shutil
    from tokenizers import Tokenizer
    path.mkdir(parents=True, exist_ok=True)
    special = {}
    if (tokenizer_dir / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, path / name)
        if (tokenizer_dir / "config.json").is_file():
            theirs = json.loads((tokenizer_dir / "config.json").read_text())
            special = {k: theirs[k] for k in ("bos_token_id", "eos_token_id") if k in theirs}
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        tok = train_tokenizer(corpus, 512 if smoke else 4096)
        tok.save(str(path / "tokenizer.json"))
    if "eos_token_id" not in special:
        special = {"bos_token_id": None, "eos_token_id": next(
            tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None)}
    vocab = -(-tok.get_vocab_size() // 64) * 64  # padded: embedding rows split evenly
    config = dict(SMOKE_MODEL if smoke else MODEL, vocab_size=vocab, **special)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def train_tokenizer(corpus: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_NAMES[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tok.train_from_iterator(docs, trainer)
    return tok


def sampler(config, max_len: int):
    """A jitted next-token function over a fixed-size buffer (one compile for every length)."""
    import jax
    import jax.numpy as jnp
    from pallasite.model import forward_logits

    @jax.jit
    def next_token(params, buf, n, key, temperature):
        logits = forward_logits(params, config, buf[None])[0, n - 1] / temperature
        kth_best = jax.lax.top_k(logits, 40)[0][-1]  # top-k sampling, k = 40
        return jax.random.categorical(key, jnp.where(logits < kth_best, -jnp.inf, logits))

    def generate(params, ids, new_tokens, seed=0, temperature=0.8):
        ids = list(ids)[-max_len + new_tokens:]
        buf = jnp.zeros(max_len, jnp.int32).at[:len(ids)].set(jnp.asarray(ids, jnp.int32))
        key = jax.random.key(seed)
        for _ in range(new_tokens):
            key, sub = jax.random.split(key)
            tok = int(next_token(params, buf, len(ids), sub, temperature))
            if tok in config.eos_token_ids:
                break
            buf = buf.at[len(ids)].set(tok)
            ids.append(tok)
        return ids
    return generate


def training_args(model_dir: Path, corpus: Path, run_dir: Path, epochs: float, smoke: bool,
                  seconds: float):
    """The `pallasite train` arguments of one run (printed into the summary)."""
    size = (["--seq-len", "128", "--batch-size", "4", "--warmup", "5", "--eval-every", "10",
             "--eval-batches", "2"] if smoke else
            ["--seq-len", "1024", "--batch-size", "16", "--warmup", "100", "--eval-every", "25",
             "--eval-batches", "8"])
    return ["--model", str(model_dir), "--data", str(corpus), "--out", str(run_dir), "--scratch",
            *size, "--epochs", str(epochs), "--lr", "1e-3", "--min-lr-ratio", "0.05",
            "--weight-decay", "0.1", "--log-every", "10", "--save-every", "0", "--export-best",
            "--export-dtype", "bfloat16", "--time-budget", str(int(seconds))]


def write_samples(export: Path, path: Path, new_tokens: int) -> list[dict]:
    """Sample a continuation of each prompt from the exported model, as a user would load it."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer
    from pallasite.model import load_hf
    config, params = load_hf(export, dtype=jnp.float32)
    tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    generate = sampler(config, min(config.max_position_embeddings, 512))
    samples = []
    for i, prompt in enumerate(PROMPTS):
        ids = generate(params, tok.encode(prompt).ids, new_tokens, seed=i)
        samples.append({"prompt": prompt, "text": tok.decode(ids)})
    path.write_text("".join(f"=== {s['prompt']!r}\n{s['text']}\n\n" for s in samples))
    return samples


def plot_loss(runs: dict[str, Path], chosen: str, png: Path):
    """Train and held-out loss of the chosen run; held-out loss of the others, dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, metrics in runs.items():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        held = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if name == chosen:
            ax.plot(*zip(*[(r["step"], r["loss"]) for r in records if "loss" in r]),
                    lw=1, label=f"train loss ({name})")
            ax.plot(*zip(*held), "o-", ms=3, label=f"held-out loss ({name})")
        elif held:
            ax.plot(*zip(*held), "--", lw=1, label=f"held-out loss ({name})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("pallasite default model: Python documentation text")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def summarize(metrics: Path, seconds: float) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    held = [r for r in records if "eval_loss" in r]
    best = min(held, key=lambda r: r["eval_loss"]) if held else {}
    return {"steps": train[-1]["step"], "epochs": round(train[-1]["epoch"], 2),
            "final_train_loss": round(train[-1]["loss"], 4),
            "best_eval_loss": best.get("eval_loss"), "best_eval_step": best.get("step"),
            "final_eval_loss": held[-1]["eval_loss"] if held else None,
            # The first interval holds the compile; leave it out of the throughput.
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in train[1:]) /
                                  max(len(train) - 1, 1)),
            "train_seconds": round(seconds, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny model and run (CPU check)")
    parser.add_argument("--minutes", type=float, default=4.0, help="time budget of all runs")
    parser.add_argument("--epochs", default="8,16,32", help="one run per epoch count; the "
                        "lowest held-out loss wins (the corpus is small: more passes overfit)")
    parser.add_argument("--tokenizer-dir", default=str(DEFAULT_DIR),
                        help="folder whose tokenizer to use (default: the embedded model's)")
    parser.add_argument("--corpus", help="a prepared corpus.jsonl (default: build it here)")
    args = parser.parse_args(argv)
    from pallasite.train.cli import main as train_main

    out, t0 = Path(args.out), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else out / "corpus.jsonl"
    corpus_info = {} if args.corpus else write_corpus(corpus)
    model_dir = make_model_dir(out / "model", Path(args.tokenizer_dir), corpus, args.smoke)
    sweep = [float(e) for e in args.epochs.split(",")]
    runs, summaries = {}, {}
    for i, epochs in enumerate(sweep):
        name = f"{epochs:g} epochs"
        # Each run gets the time left, shared in proportion to the epochs still to run.
        left = args.minutes * 60 - (time.perf_counter() - t0)
        cmd = training_args(model_dir, corpus, out / f"run{i}", epochs, args.smoke,
                            max(left * epochs / sum(sweep[i:]), 10))
        start = time.perf_counter()
        if train_main(cmd) != 0:
            sys.exit(f"training run {name} failed")
        runs[name] = out / f"run{i}" / "metrics.jsonl"
        summaries[name] = {**summarize(runs[name], time.perf_counter() - start),
                           "export": str(out / f"run{i}" / "export"),
                           "command": "pallasite train " + " ".join(cmd)}
    chosen = min(summaries, key=lambda n: summaries[n]["best_eval_loss"])
    final = finish(Path(summaries[chosen]["export"]), out / "final", args.smoke)
    plot_loss(runs, chosen, final / "loss.png")
    for name, path in runs.items():
        (final / f"metrics_{name.replace(' ', '_')}.jsonl").write_text(path.read_text())
    summary = {"chosen": chosen, "runs": summaries, "corpus": corpus_info,
               "total_seconds": round(time.perf_counter() - t0, 1)}
    (final / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print((final / "samples.txt").read_text()[:1500])
    print(json.dumps(summary, indent=2))


def finish(export: Path, final: Path, smoke: bool) -> Path:
    """Copy the chosen export to final/export with sampling defaults, and sample from it."""
    import shutil
    shutil.copytree(export, final / "export", dirs_exist_ok=True)
    gen_file = final / "export" / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen.update(do_sample=True, temperature=0.8, top_k=40)
    gen_file.write_text(json.dumps(gen, indent=2) + "\n")
    write_samples(final / "export", final / "samples.txt", 24 if smoke else 120)
    return final


if __name__ == "__main__":
    main()
