"""Training on a 2x4 (data x tensor) mesh of fake CPU devices follows the one-device loss curve."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import train_fixtures

SCRIPT = """
import sys
from pallasite.train.cli import main
model, corpus, out = sys.argv[1:4]
for mesh in ("1,1,1", "2,4,1"):
    assert main(["--model", model, "--data", corpus, "--out", f"{out}/{mesh}", "--mesh", mesh,
                 "--seq-len", "32", "--batch-size", "8", "--accum", "2", "--steps", "12",
                 "--lr", "3e-3", "--warmup", "3", "--log-every", "1", "--eval-every", "6",
                 "--save-every", "100", "--quiet"]) == 0
"""


def curve(run: Path, key: str):
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r]


def test_2x4_mesh_matches_one_device(tmp_path):
    model_dir = train_fixtures.make_model_dir(tmp_path / "model")
    corpus = train_fixtures.write_corpus(tmp_path / "docs.jsonl", 12)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(corpus),
                           str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    one, mesh = tmp_path / "1,1,1", tmp_path / "2,4,1"
    assert len(curve(one, "loss")) == 12
    np.testing.assert_allclose(curve(mesh, "loss"), curve(one, "loss"), rtol=1e-4)
    np.testing.assert_allclose(curve(mesh, "eval_loss"), curve(one, "eval_loss"), rtol=1e-4)
    assert curve(one, "loss")[-1] < curve(one, "loss")[0] - 0.5
