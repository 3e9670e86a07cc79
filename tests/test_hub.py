"""Hub names (`org/name[@revision]`) resolve through huggingface_hub's cache, offline, with no
network: a pre-populated cache folder stands in for a download."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from pallasite.model import CheckpointError, default_model_path
from pallasite.model.hub import is_repo_id, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(hub_cache: Path, repo: str, files: dict[str, Path], revision="main") -> Path:
    """Lay out `files` as huggingface_hub's cache holds a downloaded snapshot of `repo`."""
    root = hub_cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, src in files.items():
        shutil.copy(src, snapshot / name)
    (root / "refs").mkdir()
    (root / "refs" / revision).write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def default_files(names=("config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json", "generation_config.json")):
    return {n: Path(default_model_path()) / n for n in names}


def test_names_and_paths():
    assert is_repo_id("org/name") and is_repo_id("org/name@v1.0") and is_repo_id("a.b/c-d_e")
    assert not is_repo_id("name") and not is_repo_id("a/b/c") and not is_repo_id("../x")


def test_a_local_folder_wins(tmp_path, offline_cache):
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    assert resolve(folder) == folder
    assert resolve(str(folder)) == folder


def test_offline_cache_resolves_with_revision(offline_cache):
    snapshot = cache_repo(offline_cache, "org/tiny", default_files())
    assert resolve("org/tiny") == snapshot
    assert resolve("org/tiny@main") == snapshot


def test_offline_with_nothing_cached_says_so(offline_cache):
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve("org/absent")


def test_a_repo_without_safetensors_is_refused(offline_cache):
    cache_repo(offline_cache, "org/bin-only", default_files(("config.json",)))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        resolve("org/bin-only")


def test_neither_folder_nor_name(offline_cache):
    with pytest.raises(CheckpointError, match="neither a folder nor"):
        resolve("no-such-folder")


def test_cli_generates_from_a_hub_name_offline(tmp_path):
    """The real CLI in a fresh process, with HF_HOME and HF_HUB_OFFLINE=1 as a user sets them."""
    cache_repo(tmp_path / "hf" / "hub", "org/tiny", default_files())
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "pallasite.cli", "generate", "--model", "org/tiny",
                          "--prompt", "The for statement", "--max-tokens", "4",
                          "--temperature", "0"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "4 generated" in run.stderr
    missing = subprocess.run([sys.executable, "-m", "pallasite.cli", "generate", "--model",
                              "org/absent", "--prompt", "x"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode != 0
    assert "not in the local Hugging Face cache" in missing.stderr
