"""Training: packing, a loss that drops, export that transformers loads, and clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

import train_fixtures
from pallasite.model import forward_logits, init_params, load_config, load_hf
from pallasite.train.checkpoint import Checkpoints, ResumeError
from pallasite.train.cli import main as train_main
from pallasite.train.data import Batches, DataError, build_dataset, pack, read_documents
from pallasite.train.export import export_hf
from pallasite.train.loop import LoopSettings, run_loop
from pallasite.train.mesh import make_mesh
from pallasite.train.step import Hyper, Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_fixtures.make_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return train_fixtures.write_corpus(tmp_path_factory.mktemp("data") / "docs.jsonl", 12)


def test_pack_keeps_documents_apart():
    docs = [np.array([5, 6, 7, 0]), np.array([8, 9, 0]), np.array([3, 4, 2, 1, 0])]
    rows = pack(docs, seq_len=5)
    expect = {
        "inputs": [[5, 6, 7, 0, 8], [9, 0, 3, 4, 2], [1, 0, 0, 0, 0]],
        "targets": [[6, 7, 0, 8, 9], [0, 3, 4, 2, 1], [0, 0, 0, 0, 0]],
        "segment_ids": [[1, 1, 1, 1, 2], [2, 2, 3, 3, 3], [3, 3, 0, 0, 0]],
        # Positions restart with each document and where a document enters a new row.
        "positions": [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2], [0, 1, 0, 1, 2]],
        # No loss on EOS -> next document, nor on padding.
        "loss_mask": [[1, 1, 1, 0, 1], [1, 0, 1, 1, 1], [1, 0, 0, 0, 0]],
    }
    for field, want in expect.items():
        np.testing.assert_array_equal(rows[field], want, err_msg=field)


def test_batches_are_a_function_of_seed_and_step(model_dir, corpus):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encode = lambda text: tok.encode(text).ids
    data = build_dataset([corpus], encode, 0, 32, seed=3, eval_fraction=0.1)
    assert len(data.eval["inputs"]) >= 1 and data.seq_len == 32
    a, b = Batches(data.train, 4, 2, seed=1), Batches(data.train, 4, 2, seed=1)
    for step in (0, 7, 500):  # 500 is many epochs in: each epoch has its own order
        assert a(step)["inputs"].shape == (2, 4, 32)
        np.testing.assert_array_equal(a(step)["inputs"], b(step)["inputs"])
    n = len(data.train["inputs"])
    per_epoch = np.concatenate([a.indices(s) for s in range(-(-n // 8))])[:n]
    assert sorted(per_epoch) == list(range(n))  # an epoch visits each row once
    assert not np.array_equal(Batches(data.train, 4, 2, seed=2)(0)["inputs"], a(0)["inputs"])


def test_train_extra_joins_the_training_rows_only(model_dir, corpus, tmp_path):
    """Extra documents (a draft's generated text) add training rows; the held-out rows stay
    exactly those of the data alone."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encode = lambda text: tok.encode(text).ids
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"text": f"generated text number {i} " * 6}) + "\n"
                             for i in range(20)))
    base = build_dataset([corpus], encode, 0, 32, seed=3, eval_fraction=0.1)
    more = build_dataset([corpus], encode, 0, 32, seed=3, eval_fraction=0.1, train_extra=[extra])
    for field in base.eval:
        np.testing.assert_array_equal(more.eval[field], base.eval[field], err_msg=field)
    assert len(more.train["inputs"]) > len(base.train["inputs"])
    assert more.num_docs == base.num_docs + 20
    n = len(base.train["inputs"])  # the extra rows come first, then the data's own
    np.testing.assert_array_equal(more.train["inputs"][-n:], base.train["inputs"])


def tiny_trainer(model_dir, corpus, steps, lr=3e-3, mesh=(1, 1, 1)):
    config = load_config(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    data = build_dataset([corpus], lambda text: tok.encode(text).ids, 0, 32, eval_fraction=0.1)
    trainer = Trainer(config, Hyper(lr=lr, warmup_steps=5, total_steps=steps), make_mesh(*mesh))
    return config, data, trainer


def test_loss_drops(model_dir, corpus, tmp_path):
    config, data, trainer = tiny_trainer(model_dir, corpus, steps=40)
    state = trainer.init(init_params(config, 0), 0)
    settings = LoopSettings(steps=40, batch_size=8, accum=2, eval_every=40, log_every=1,
                            quiet=True)
    evals = []
    state = run_loop(trainer, state, data, settings, metrics_file=tmp_path / "m.jsonl",
                     on_eval=lambda step, st, result: evals.append(result))
    records = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 40 and int(state["step"]) == 40
    assert losses[0] > np.log(config.vocab_size) - 0.5  # starts near uniform
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert evals[-1]["eval_loss"] < losses[0] - 0.8
    assert np.isclose(evals[-1]["eval_ppl"], np.exp(evals[-1]["eval_loss"]))


def test_export_loads_in_transformers_and_pallasite(model_dir, tmp_path):
    config = load_config(model_dir)
    params = init_params(config, seed=1)
    # Every tensor, norm scales too, gets its own noise: a swapped tensor cannot hide.
    leaves, tree = jax.tree.flatten(params)
    params = tree.unflatten([p + 0.05 * jax.random.normal(jax.random.key(i), p.shape)
                             for i, p in enumerate(leaves)])
    out = export_hf(params, config, tmp_path / "export", model_dir)
    _, loaded = load_hf(out, dtype=jnp.float32)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 40))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(forward_logits(params, config, jnp.asarray(ids)), np.float64)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= 1e-4

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "The for statement is used to iterate"
    ours_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok(text)["input_ids"] == ours_tok.encode(text).ids
    assert tok.eos_token_id == 0


def test_empty_data_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="every document is empty"):
        read_documents([tmp_path / "empty.txt", tmp_path / "empty.jsonl"])
    with pytest.raises(DataError, match="does not exist"):
        read_documents([tmp_path / "missing.txt"])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 .* \"text\" field"):
        read_documents([tmp_path / "bad.jsonl"])


def test_cli_reports_bad_inputs(model_dir, corpus, tmp_path, capsys):
    base = ["--model", str(model_dir), "--out", str(tmp_path / "run"), "--steps", "2", "--quiet"]
    (tmp_path / "empty.txt").write_text("")
    assert train_main(base + ["--data", str(tmp_path / "empty.txt")]) == 2
    assert "every document is empty" in capsys.readouterr().err
    assert train_main(base + ["--data", str(corpus), "--seq-len", "129"]) == 2
    assert "--seq-len 129 is outside 1..128" in capsys.readouterr().err


def test_corrupt_checkpoint_is_a_clear_error(model_dir, corpus, tmp_path, capsys):
    args = ["--model", str(model_dir), "--data", str(corpus), "--out", str(tmp_path / "run"),
            "--seq-len", "32", "--batch-size", "4", "--steps", "2", "--save-every", "1",
            "--eval-every", "0", "--quiet"]
    assert train_main(args) == 0
    step_dir = tmp_path / "run" / "checkpoints" / "2"
    for f in (step_dir / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {step_dir} cannot be restored" in err and "delete that folder" in err
    # Settings that differ from the checkpoint's are refused, not silently mixed.
    (tmp_path / "run" / "checkpoints" / "2").rename(tmp_path / "moved")
    assert train_main([a if a != "4" else "2" for a in args]) == 2
    assert "was written with batch_size=4, but this run has batch_size=2" in capsys.readouterr().err
    # A folder that is not a checkpoint folder at all.
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResumeError, match="is not a folder"):
        Checkpoints(tmp_path / "file", 1, 1)
