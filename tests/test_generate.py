"""Generation end to end: greedy tokens equal `transformers`' greedy `generate`; the CLI on a
checkpoint folder and on the embedded default model."""

import jax
import numpy as np
import pytest
import torch

import hf_models
import tok_fixtures
from pallasite.cli import main as cli_main
from pallasite.model import default_model_path, forward_logits, load_hf
from pallasite.serving.llm import LLM, SamplingParams


PROMPTS = [[5, 17, 99, 3, 42], [7] * 3 + [64, 12, 90, 33, 8, 120, 4, 6, 77], [11]]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_greedy_32_tokens_equal_transformers(family, tmp_path):
    model = hf_models.save(family, tmp_path)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                               max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]
    with LLM(tmp_path, max_model_len=64, num_pages=32, page_size=8, max_num_seqs=4,
             max_num_batched_tokens=16, token_buckets=[4, 16], page_buckets=[8],
             warmup=False) as llm:  # compiles only what the greedy steps use
        got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [g.token_ids for g in got] == want


def test_cli_generate_streams_from_a_checkpoint_folder(tmp_path, capsys):
    tok = tok_fixtures.byte_level(400)
    model = hf_models.build("llama")
    model.resize_token_embeddings(tok.get_vocab_size())
    model.save_pretrained(tmp_path)
    tok_fixtures.save(tok, tmp_path)
    assert cli_main(["generate", "--model", str(tmp_path), "--prompt", "def f(x):",
                     "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert "[" in out.err and "6 generated" in out.err and "tokens/s" in out.err
    assert out.out.endswith("\n")
    with pytest.raises(SystemExit, match="max_model_len"):  # a clear error, no traceback
        cli_main(["generate", "--model", str(tmp_path), "--prompt", "many words " * 300,
                  "--max-model-len", "64"])


def test_cli_rejects_bad_sampling_flags(tmp_path):
    hf_models.save("llama", tmp_path)
    with pytest.raises(SystemExit, match="top_p"):
        cli_main(["generate", "--model", str(tmp_path), "--prompt", "x", "--top-p", "0"])


def test_the_default_model_knows_its_corpus():
    """The shipped weights are trained: a passage of Python's documentation costs far fewer nats
    per token than chance (ln 4096 = 8.3), and a shuffled copy of it costs more."""
    import pydoc_data.topics
    config, params = load_hf(default_model_path())
    from pallasite.model.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(default_model_path())
    ids = np.array(tok.encode(pydoc_data.topics.topics["for"])[:256])
    shuffled = np.random.default_rng(0).permutation(ids)

    def nll(x):
        logits = forward_logits(params, config, x[None, :-1])[0]
        logp = jax.nn.log_softmax(logits.astype(np.float32))
        return float(-np.mean(np.take_along_axis(np.asarray(logp), x[1:, None], 1)))

    assert nll(ids) < 4.0 < nll(shuffled)


def test_cli_generate_with_no_model_uses_the_default(capsys):
    assert cli_main(["generate", "--prompt", "The for statement", "--max-tokens", "8",
                     "--seed", "0", "--max-model-len", "128"]) == 0
    out = capsys.readouterr()
    assert "embedded default model" in out.err and "8 generated" in out.err
    assert len(out.out.strip()) > 0


def test_cli_generate_batch_invariant_speculation_keeps_the_greedy_answer(capsys, monkeypatch):
    from pallasite.serving import engine
    asked, real = [], engine.Engine.__init__

    def spy(self, *a, **kw):
        asked.append(kw.get("batch_invariant"))
        real(self, *a, **kw)
    monkeypatch.setattr(engine.Engine, "__init__", spy)
    base = ["generate", "--prompt", "The for statement", "--max-tokens", "12", "--temperature",
            "0", "--max-model-len", "128"]
    assert cli_main(base) == 0
    plain = capsys.readouterr().out
    assert cli_main(base + ["--batch-invariant", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    assert capsys.readouterr().out == plain and asked == [None, True]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("spec, words", [
    ('{"method": "medusa"}', ["medusa"]),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens"]),
    ('{"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 4}',
     ["/no/such/draft"]),
    ("not json", ["JSON"])])
def test_a_bad_speculative_config_is_a_usage_error(command, spec, words, capsys):
    with pytest.raises(SystemExit) as e:
        args = [command, "--prompt", "x"] if command == "generate" else [command]
        cli_main(args + ["--speculative-config", spec])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--speculative-config" in err
    assert all(w in err for w in words), err
