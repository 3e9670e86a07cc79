"""A real-shaped checkpoint on an ordinary CPU machine, as a new user runs it: `LLM(path)` with
default settings. Measures the time until ready, the peak resident memory, and the first token
(and the whole) of a 20-token greedy chat answer.

The checkpoint is a 30-layer, 135M-parameter Llama of SmolLM2-135M's shapes (hidden 576, GQA 9/3,
SwiGLU 1536, vocabulary 49152, context 8192, tied embeddings, bf16 on disk) with random weights,
made with `transformers`, and the embedded default model's tokenizer and chat template padded
with extra tokens to the same vocabulary.

    python -m benchmarks.cpu_ready --out docs/benchmarks/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
              rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
QUESTION = "What does the for statement do?"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_checkpoint(folder: Path):
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer
    from pallasite.model import default_model_path
    default = Path(default_model_path())
    tok = Tokenizer.from_file(str(default / "tokenizer.json"))
    tok.add_tokens([AddedToken(f"<extra_{i}>", special=False)
                    for i in range(SHAPES["vocab_size"] - tok.get_vocab_size())])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    tok_config = json.loads((default / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHATML  # the default model has none; SmolLM2-Instruct's form
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    special = json.loads((default / "config.json").read_text())
    config = transformers.LlamaConfig(**SHAPES, bos_token_id=special.get("bos_token_id"),
                                      eos_token_id=special.get("eos_token_id"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def child(folder: str):
    """In a fresh process: ready time, peak RSS, first token of a greedy chat answer."""
    t0 = time.perf_counter()
    import pallasite
    llm = pallasite.LLM(folder)
    ready = time.perf_counter() - t0
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                               add_generation_prompt=True)
    t1, first, n = time.perf_counter(), None, 0
    for out in llm.stream(prompt, pallasite.SamplingParams(max_tokens=20, temperature=0.0,
                                                           ignore_eos=True)):
        first = first or time.perf_counter() - t1
        n += len(out.new_token_ids)
    total = time.perf_counter() - t1
    e = llm.engine
    print(json.dumps(dict(ready_s=ready, first_token_s=first, answer_s=total, answer_tokens=n,
                          compilations=e.compilations, token_buckets=e.token_buckets,
                          page_buckets=e.page_buckets, max_model_len=e.max_model_len,
                          num_pages=e.pages.num_pages,
                          peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)))
    llm.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=os.path.expanduser("~/.cache/pallasite/bench/llama-135m-30l"))
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.checkpoint)
    folder = Path(args.checkpoint)
    if not (folder / "model.safetensors").exists():
        make_checkpoint(folder)
    env = {**os.environ, "PALLASITE_CACHE_DIR": ""}  # a first start: nothing compiled before
    run = subprocess.run([sys.executable, "-m", "benchmarks.cpu_ready", "--child", "--checkpoint",
                          str(folder)], env=env, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"the measured process failed:\n{run.stderr[-4000:]}")
    rec = json.loads(run.stdout.strip().splitlines()[-1])
    import jax
    rec.update(mode="cpu_ready", model="llama-135m-30l (random, SmolLM2-135M shapes)",
               cores=os.cpu_count(), machine=platform.processor() or platform.machine(),
               jax_version=jax.__version__, date=time.strftime("%Y-%m-%d"),
               targets=dict(ready_s=90, peak_rss_gb=6, first_token_s=2),
               command="python -m benchmarks.cpu_ready" + (f" --out {args.out}" if args.out else ""))
    print(f"ready {rec['ready_s']:.1f} s (target 90), peak RSS {rec['peak_rss_gb']:.2f} GB (6), "
          f"first token {rec['first_token_s']:.2f} s (2), 20 tokens {rec['answer_s']:.2f} s, "
          f"{rec['compilations']} compilations")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
