"""Distillation: the KL against numpy, the mixed objective, a student that moves toward its
teacher, and the CLI's --teacher."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_fixtures
from pallasite.model import config_from_dict, forward_logits, init_params, load_config
from pallasite.train.cli import main as train_main
from pallasite.train.export import export_hf
from pallasite.train.step import Distill, distill_kl, loss_sums

TEACHER = dict(train_fixtures.CONFIG, hidden_size=96, intermediate_size=192, num_hidden_layers=3)


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_kl(student, teacher, t):
    lp, lq = np_log_softmax(teacher / t), np_log_softmax(student / t)
    return (np.exp(lp) * (lp - lq)).sum(-1) * t * t


@pytest.mark.parametrize("t", [1.0, 2.5])
def test_distill_kl_matches_numpy(t):
    rng = np.random.default_rng(0)
    s, te = rng.normal(0, 3, (2, 5, 33)), rng.normal(0, 3, (2, 5, 33))
    got = np.asarray(distill_kl(jnp.asarray(s, jnp.float32), jnp.asarray(te, jnp.float32), t))
    np.testing.assert_allclose(got, np_kl(s, te, t), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(distill_kl(jnp.asarray(s), jnp.asarray(s), t)) < 1e-5)


def test_objective_mixes_kl_and_cross_entropy():
    student_cfg = config_from_dict(train_fixtures.CONFIG)
    teacher_cfg = config_from_dict(TEACHER)
    init = jax.jit(init_params, static_argnums=(0, 1))  # eagerly it compiles op by op
    student, teacher = init(student_cfg, 1), init(teacher_cfg, 2)
    rng = np.random.default_rng(3)
    B, T, V = 2, 16, student_cfg.vocab_size
    inputs = rng.integers(0, V, (B, T))
    batch = dict(inputs=jnp.asarray(inputs), targets=jnp.asarray(rng.integers(0, V, (B, T))),
                 positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
                 segment_ids=jnp.ones((B, T), jnp.int32),
                 loss_mask=jnp.asarray(rng.random((B, T)) < 0.7, jnp.float32))
    w, t = 0.3, 2.0
    distill = Distill(teacher_cfg, w, t)
    objective = jax.jit(lambda sp, tp: loss_sums(sp, student_cfg, batch, jnp.float32, distill,
                                                 tp))
    total, sums = objective(student, teacher)
    logits = jax.jit(forward_logits, static_argnums=1)
    s = np.asarray(logits(student, student_cfg, batch["inputs"]), np.float64)
    te = np.asarray(logits(teacher, teacher_cfg, batch["inputs"]), np.float64)
    mask, tgt = np.asarray(batch["loss_mask"]), np.asarray(batch["targets"])
    ce = -np.take_along_axis(np_log_softmax(s), tgt[..., None], -1)[..., 0]
    kl = np_kl(s, te, t)
    np.testing.assert_allclose(float(total), ((w * kl + (1 - w) * ce) * mask).sum(), rtol=1e-4)
    np.testing.assert_allclose(float(sums["kl"]), (kl * mask).sum(), rtol=1e-4)
    np.testing.assert_allclose(float(sums["ce"]), (ce * mask).sum(), rtol=1e-4)
    assert float(sums["agree"]) == ((s.argmax(-1) == te.argmax(-1)) * mask).sum()
    # The teacher is frozen: no gradient flows into it.
    g = jax.jit(jax.grad(lambda tp: objective(student, tp)[0]))(teacher)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))


def test_cli_distills_toward_the_teacher(tmp_path, capsys):
    """A student trained on --teacher's distributions gets closer to it (KL down, agreement
    up), and the run logs both; a teacher of another vocabulary is a usage error."""
    student = train_fixtures.make_model_dir(tmp_path / "student")
    corpus = train_fixtures.write_corpus(tmp_path / "docs.jsonl", 12)
    teacher_cfg = config_from_dict(TEACHER)
    params = init_params(teacher_cfg, 5)  # a peaked teacher: far from the student at the start
    params["lm_head"] = params["lm_head"] * 10.0
    export_hf(params, teacher_cfg, tmp_path / "teacher", student)
    (tmp_path / "teacher" / "config.json").write_text(json.dumps(TEACHER))
    args = ["--model", str(student), "--data", str(corpus), "--out", str(tmp_path / "run"),
            "--teacher", str(tmp_path / "teacher"), "--distill-weight", "0.9",
            "--seq-len", "32", "--batch-size", "8", "--steps", "24", "--warmup", "3",
            "--lr", "1e-2", "--eval-every", "12", "--eval-batches", "2", "--log-every", "5",
            "--save-every", "0", "--quiet"]
    assert train_main(args) == 0
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_kl" in r]
    steps = [r for r in records if "kl" in r]
    assert len(evals) == 2 and steps and all(0 <= r["agree"] <= 1 for r in steps)
    assert steps[-1]["kl"] < 0.93 * steps[0]["kl"], steps
    assert evals[-1]["eval_kl"] < evals[0]["eval_kl"], evals
    assert 0 <= evals[-1]["eval_agree"] <= 1
    assert np.isclose(evals[-1]["eval_loss"],
                      0.9 * evals[-1]["eval_kl"] + 0.1 * evals[-1]["eval_ce"], rtol=1e-4)

    other = dict(TEACHER, vocab_size=512)
    (tmp_path / "teacher" / "config.json").write_text(json.dumps(other))
    assert train_main(args[:5] + [str(tmp_path / "run2")] + args[6:]) == 2
    err = capsys.readouterr().err
    assert "512 tokens" in err and "384 tokens" in err
