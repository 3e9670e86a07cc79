"""Checkpoints: a run killed (SIGKILL, saves in flight) and resumed ends with parameters bitwise
identical to an uninterrupted run's; an interrupted save is never restored."""

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

import train_fixtures
from pallasite.train.checkpoint import Checkpoints

STEPS = 12


def train_args(model_dir, corpus, out):
    return [sys.executable, "-m", "pallasite.train", "--model", str(model_dir), "--data",
            str(corpus), "--out", str(out), "--seq-len", "32", "--batch-size", "4", "--accum", "2",
            "--steps", str(STEPS), "--lr", "3e-3", "--warmup", "3", "--eval-every", "0",
            "--log-every", "1", "--save-every", "1", "--keep", "2"]


def run_until_killed(args, out, kill_after_step: int):
    """Start training and SIGKILL it after `kill_after_step`, at a moment when a save is
    half-written (it saves every step, so one nearly always is)."""
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=_env())
    for line in proc.stderr:
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= kill_after_step:
            if any((out / "checkpoints").glob("*.orbax-checkpoint-tmp*")):
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed mid-save"


def _env():
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def final_params(out):
    return load_file(str(out / "export" / "model.safetensors"))


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    model_dir = train_fixtures.make_model_dir(tmp_path / "model")
    corpus = train_fixtures.write_corpus(tmp_path / "docs.jsonl", 12)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(train_args(model_dir, corpus, whole), check=True, env=_env(),
                   capture_output=True)
    run_until_killed(train_args(model_dir, corpus, killed), killed, kill_after_step=5)
    resumed_from = Checkpoints(killed / "checkpoints", 1, 2).latest_step()
    assert resumed_from is not None and 1 <= resumed_from < STEPS
    done = subprocess.run(train_args(model_dir, corpus, killed), env=_env(), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {killed / 'checkpoints'}/{resumed_from}" in done.stderr
    assert not any((killed / "checkpoints").glob("*.orbax-checkpoint-tmp*"))  # cleaned up
    a, b = final_params(whole), final_params(killed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_interrupted_save_is_never_restored(tmp_path):
    """A step folder left half-written (orbax's temporary name, as a kill mid-save leaves it)
    is skipped: the latest finished step is restored."""
    model_dir = train_fixtures.make_model_dir(tmp_path / "model")
    corpus = train_fixtures.write_corpus(tmp_path / "docs.jsonl", 4)
    out = tmp_path / "run"
    args = train_args(model_dir, corpus, out)
    args[args.index("--steps") + 1] = "3"
    subprocess.run(args, check=True, env=_env(), capture_output=True)
    ckpts = out / "checkpoints"
    partial = ckpts / "7.orbax-checkpoint-tmp-1234567"
    shutil.copytree(ckpts / "3", partial)
    for f in sorted(p for p in partial.rglob("*") if p.is_file())[::2]:
        f.unlink()  # half of the files never got written
    assert Checkpoints(ckpts, 1, 2).latest_step() == 3
