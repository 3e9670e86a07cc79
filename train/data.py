"""Training data: text or JSONL documents -> tokens -> packed fixed-length rows.

Documents are tokenized as the server tokenizes a prompt (so BOS appears if the tokenizer adds
one), each ends with EOS, and all are packed back to back into rows of `seq_len` tokens. Each row
carries per-token segment ids (attention never crosses documents), per-document positions
(restarting where a document, or a row, begins) and a loss mask (no loss on predicting the next
document's first token, nor on padding). Batches are a pure function of (seed, step), so a
resumed run only needs the step to continue exactly where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


class DataError(ValueError):
    """Training data that cannot be used: missing files, no text, a malformed JSONL line."""


def read_documents(paths) -> list[str]:
    """A `.jsonl` file gives one document per line (its "text" field); any other file is one
    document of plain text."""
    if not paths:
        raise DataError("no training data given")
    docs = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"training data file {path} does not exist")
        if path.suffix == ".jsonl":
            docs += _read_jsonl(path)
        else:
            docs.append(path.read_text(encoding="utf-8"))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"no text in the training data {[str(p) for p in paths]}: "
                        "every document is empty")
    return docs


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            docs.append(json.loads(line)["text"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{path}:{n} is not a JSON object with a \"text\" field") from None
    return docs


def tokenize(docs: list[str], encode, eos_id: int) -> list[np.ndarray]:
    """Each document's token ids (`encode(text) -> ids`, as for a prompt), EOS appended: the
    model learns where text ends."""
    return [np.asarray(list(encode(d)) + [eos_id], np.int32) for d in docs]


def pack(token_docs: list[np.ndarray], seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Concatenate documents and cut rows of seq_len inputs (+1 for the shifted targets).
    Returns FIELDS, each [rows, seq_len]. Segment ids count documents from 1; padding is 0."""
    stream = np.concatenate(token_docs)
    segment = np.concatenate([np.full(len(t), i + 1, np.int32) for i, t in enumerate(token_docs)])
    rows = max(1, -(-(len(stream) - 1) // seq_len))
    total = rows * seq_len + 1
    stream = np.pad(stream, (0, total - len(stream)), constant_values=pad_id)
    segment = np.pad(segment, (0, total - len(segment)))
    take = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    toks, segs = stream[take], segment[take]
    seg_in = segs[:, :-1]
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg_in,
            "positions": _positions(seg_in),
            "loss_mask": ((seg_in == segs[:, 1:]) & (seg_in > 0)).astype(np.float32)}


def _positions(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token within its document, counting from where it enters the row."""
    t = np.arange(segment_ids.shape[1])
    starts = np.ones_like(segment_ids, bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    return (t - first).astype(np.int32)


@dataclasses.dataclass
class Dataset:
    """Packed rows split into train and held-out parts; rows are dicts of FIELDS."""
    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]
    num_docs: int
    num_tokens: int

    @property
    def seq_len(self) -> int:
        return self.train["inputs"].shape[1]


def build_dataset(paths, encode, eos_id: int, seq_len: int, seed: int = 0,
                  eval_fraction: float = 0.05, train_extra=()) -> Dataset:
    """Read, tokenize, shuffle documents by `seed`, pack, and hold out the last rows for eval.
    Documents of `train_extra` join the training rows only: the held-out rows stay as they are."""
    docs = tokenize(read_documents(paths), encode, eos_id)
    order = np.random.default_rng(seed).permutation(len(docs))
    rows = pack([docs[i] for i in order], seq_len)
    n_eval = int(np.ceil(len(rows["inputs"]) * eval_fraction)) if eval_fraction > 0 else 0
    if train_extra:
        extra = tokenize(read_documents(train_extra), encode, eos_id)
        more = pack([extra[i] for i in np.random.default_rng(seed).permutation(len(extra))],
                    seq_len)
        rows = {k: np.concatenate([more[k], v]) for k, v in rows.items()}  # held out: the end
        docs = docs + extra
    n = len(rows["inputs"])
    if n - n_eval < 1:
        raise DataError(f"the data makes {n} row(s) of {seq_len} tokens: too few to hold out "
                        f"{n_eval} for evaluation (lower --eval-fraction or add data)")
    split = lambda sl: {k: v[sl] for k, v in rows.items()}
    return Dataset(split(slice(0, n - n_eval)), split(slice(n - n_eval, n)), len(docs),
                   int(sum(len(d) for d in docs)))


class Batches:
    """Training batches as a pure function of the step: sample k of the run is row
    perm_e[k mod N] of epoch e = k // N, perm_e a permutation seeded by (seed, e)."""

    def __init__(self, rows: dict[str, np.ndarray], batch_size: int, accum: int, seed: int):
        self.rows, self.batch_size, self.accum, self.seed = rows, batch_size, accum, seed
        self.n = len(rows["inputs"])
        self._perms = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        per_step = self.batch_size * self.accum
        samples = step * per_step + np.arange(per_step)
        epochs = samples // self.n
        return np.array([self._perm(e)[k % self.n] for e, k in zip(epochs, samples)])

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        """The batch of `step`: each field [accum, batch_size, seq_len]."""
        idx = self.indices(step).reshape(self.accum, self.batch_size)
        return {k: v[idx] for k, v in self.rows.items()}

    def epoch(self, step: int) -> float:
        return step * self.batch_size * self.accum / self.n


def eval_batches(rows: dict[str, np.ndarray], batch_size: int, max_batches: int | None = None):
    """Held-out rows in order, in full batches (the last one padded with masked-out rows)."""
    n = len(rows["inputs"])
    count = -(-n // batch_size)
    if max_batches:
        count = min(count, max_batches)
    for b in range(count):
        sl = slice(b * batch_size, (b + 1) * batch_size)
        batch = {k: v[sl] for k, v in rows.items()}
        short = batch_size - len(batch["inputs"])
        if short:
            batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
        yield batch
