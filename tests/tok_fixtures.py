"""Tokenizers built on the spot (no network): a byte-level BPE and a sentencepiece-style BPE with
byte fallback, saved as checkpoint files."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEXT = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
        "Python is a programming language that lets you work quickly.",
        "Lists, tuples and dicts are built in.", "héllo wörld — naïve café"] * 20

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
                 "<|system|>{{ m['content'] | trim }}\n{% else %}<|{{ m['role'] }}|>"
                 "{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_level(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    return tok


def sentencepiece_like(vocab_size: int = 300) -> Tokenizer:
    """BPE over Metaspace pieces with <0xNN> byte tokens for anything unseen."""
    def build(model):
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        return tok
    trained = build(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(trained.to_str())["model"]
    # Byte tokens must live in the model's own vocabulary for byte fallback to find them.
    vocab = dict(spec["vocab"])
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = build(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def save(tok: Tokenizer, folder, bos="<|bos|>", eos="<|eos|>", add_bos=True, template=CHAT_TEMPLATE):
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "add_bos_token": add_bos,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id(eos)}))
    return folder
