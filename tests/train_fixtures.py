"""A tiny model folder (config.json + a small byte-level BPE tokenizer) and a small corpus for
the training tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=384,
              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0)


def corpus_docs(n: int = 40) -> list[str]:
    """Python's own help topics (PSF license), the first n non-trivial ones."""
    import pydoc_data.topics
    return [t for _, t in sorted(pydoc_data.topics.topics.items()) if len(t) > 500][:n]


def write_corpus(path: Path, n: int = 40) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus_docs(n)))
    return path


def make_model_dir(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_docs(), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({**CONFIG, **overrides}))
    return path
