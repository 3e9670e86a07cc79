"""Tokenizer of a checkpoint folder: `tokenizer.json` through the `tokenizers` library, special
tokens and EOS ids from the configs, chat templates rendered as Hugging Face renders them, and
incremental detokenization for streaming.
"""

from __future__ import annotations

import json
import weakref
from datetime import datetime
from itertools import repeat
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """A checkpoint folder whose tokenizer cannot be loaded or used as asked."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _token_text(value) -> str | None:
    """Special tokens appear as plain strings or as {"content": ...} objects."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [int(value)]


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict, eos_ids: tuple[int, ...],
                 chat_template: str | None):
        self.tok, self.config, self.eos_token_ids, self.chat_template = tok, config, eos_ids, chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"no tokenizer.json in {path}: only fast (tokenizers) "
                                 "tokenizers are supported")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise TokenizerError(f"cannot read {file}: {e}") from None
        config = {**_read_json(path / "special_tokens_map.json"),
                  **_read_json(path / "tokenizer_config.json")}
        eos = set(_ids(_read_json(path / "generation_config.json").get("eos_token_id")))
        eos |= set(_ids(_read_json(path / "config.json").get("eos_token_id")))
        eos_text = _token_text(config.get("eos_token"))
        if eos_text and tok.token_to_id(eos_text) is not None:
            eos.add(tok.token_to_id(eos_text))
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, config, tuple(sorted(eos)), template)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return self.tok.decode_batch([ids if type(ids) is list else list(ids) for ids in batch],
                                     skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **variables) -> str:
        """Render the checkpoint's chat template the way `transformers` does."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat_template in tokenizer_config.json")
        specials = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{**specials, **variables})


def _raise(message):
    raise TokenizerError(f"chat template error: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_templates: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _templates:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _templates[source] = env.from_string(source)
    return _templates[source]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each new token is decoded together with a few tokens before it and only the difference is
    emitted: this keeps the spaces that depend on the previous token, and a delta is held back
    while it ends in an incomplete UTF-8 character (U+FFFD) until the bytes that finish it come.

    The text of the window before the new token is kept until a delta moves the window; after
    one, the window is mostly the single token just emitted, whose text comes from a table kept
    per tokenizer. So a token costs about one decode, not two.
    """

    __slots__ = ("tokenizer", "ids", "read", "prefix", "before")
    CONTEXT = 5  # prompt tokens decoded along with the first output token
    _singles = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text decoded alone}

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT:])  # nothing before the window is read again
        self.read = len(self.ids)  # tokens already turned into text
        self.prefix = max(0, self.read - self.CONTEXT)  # start of the decoding window
        self.before = None  # the text of ids[prefix:read], once decoded

    def add(self, token_id: int) -> str:
        return self.add_many([self], [token_id])[0]

    @staticmethod
    def add_many(detoks: list["IncrementalDetokenizer"], token_ids: list,
                 final: list[bool] | None = None) -> list[str]:
        """New tokens for each detokenizer (a token id, or a list of them); their deltas, decoded
        in one batched call where every detokenizer shares a tokenizer that has `decode_batch`.
        A `final` one holds nothing back: an unfinished character at the end comes as U+FFFD."""
        if not detoks:
            return []
        tok = detoks[0].tokenizer
        shared = all(d.tokenizer is tok for d in detoks)
        singles = IncrementalDetokenizer._singles_of(tok) if shared else {}
        windows, owners = [], []  # what to decode, and for which detokenizer
        for d, token in zip(detoks, token_ids):
            ids, prefix = d.ids, d.prefix
            if type(token) is list:
                ids += token
            else:
                ids.append(token)
            if d.before is None:
                if d.read - prefix == 1:
                    d.before = singles.get(ids[prefix])
                if d.before is None:
                    windows.append(ids[prefix:d.read])
                    owners.append(d)
            windows.append(ids[prefix:])
            owners.append(d)
        texts = iter(tok.decode_batch(windows) if shared and hasattr(tok, "decode_batch") else
                     [d.tokenizer.decode(w) for d, w in zip(owners, windows)])
        out, final = [], final or repeat(False)
        for d, last in zip(detoks, final):
            before = d.before
            if before is None:
                before = d.before = next(texts)
                if d.read - d.prefix == 1:
                    singles[d.ids[d.prefix]] = before
            text = next(texts)
            if len(text) <= len(before) or (not last and text[-1] == "\ufffd"):
                out.append("")
                continue
            d.prefix, d.read, d.before = d.read, len(d.ids), None
            out.append(text[len(before):])
        return out

    @staticmethod
    def _singles_of(tok) -> dict:
        try:
            return IncrementalDetokenizer._singles.setdefault(tok, {})
        except TypeError:  # a tokenizer that takes no weak reference: no table
            return {}
