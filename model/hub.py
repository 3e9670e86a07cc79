"""Model names from the Hugging Face Hub: `org/name` or `org/name@revision` becomes a local folder.

A path that exists always wins. Anything else shaped like a repository id goes through
`huggingface_hub.snapshot_download`, so the standard cache, `HF_HOME`, `HF_HUB_OFFLINE=1` and
token handling (`HF_TOKEN`, `huggingface-cli login`) work as that library does them. Only the
files a checkpoint needs are fetched: weights, configs and tokenizer files.
"""

from __future__ import annotations

import re
from pathlib import Path

from .loader import CheckpointError

ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.model", "*.txt",
                  "*.jinja", "tokenizer*"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".")


def resolve(name_or_path) -> Path:
    """The local folder for a checkpoint path or a Hub name (downloaded or cached)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if not is_repo_id(name):
        raise CheckpointError(f"{name!r} is neither a folder nor a Hugging Face model name "
                              "(org/name or org/name@revision)")
    repo, _, revision = name.partition("@")
    folder = Path(_download(repo, revision or None))
    if not any(folder.glob("*.safetensors")):
        found = sorted(p.name for p in folder.iterdir())
        raise CheckpointError(f"the Hub repository {repo} has no *.safetensors weights (found: "
                              f"{found}); only safetensors checkpoints are supported")
    return folder


def _download(repo: str, revision: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - a dependency; kept for a clear message
        raise CheckpointError(f"{repo}: loading Hub names needs the huggingface_hub package") from None
    where = f"{repo}" + (f"@{revision}" if revision else "")
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except errors.GatedRepoError:
        raise CheckpointError(f"{where} is gated: accept its terms on the Hub, then log in "
                              "(`hf auth login`) or set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"{where}: no such model repository on the Hub (or it is private "
                              "and no token with access was given)") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{where}: the repository has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        raise CheckpointError(f"{where} is not in the local Hugging Face cache and the Hub cannot "
                              "be reached (HF_HUB_OFFLINE is set, or no network)") from None
    except errors.HfHubHTTPError as e:
        raise CheckpointError(f"{where}: the Hub answered {e}") from None
