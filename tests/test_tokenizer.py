"""Tokenizer: special tokens from the configs, chat templates as transformers renders them, and
streaming detokenization that never breaks a character or a space."""

import json

import pytest
import transformers

import tok_fixtures
from pallasite.model.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TRICKY = ["Hello wörld 👋🏽 — 你好，世界! naïve café 🐍", "  leading spaces\n\ttabs 🤖🤖",
          "日本語のテキストと emoji 🎉 mixed", "a"]


@pytest.fixture(params=["byte_level", "sentencepiece_like"])
def tokenizer(request, tmp_path):
    if request.param == "byte_level":
        tok_fixtures.save(tok_fixtures.byte_level(), tmp_path)
    else:
        tok_fixtures.save(tok_fixtures.sentencepiece_like(), tmp_path, bos="<s>", eos="</s>")
    return Tokenizer.from_pretrained(tmp_path)


def test_streaming_round_trip(tokenizer):
    for text in TRICKY:
        prompt = tokenizer.encode("Python says:")
        out = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add(t) for t in out]
        assert not any("\ufffd" in d for d in deltas)
        assert tokenizer.decode(prompt) + "".join(deltas) == tokenizer.decode(prompt + out)
        assert text.strip() in "".join(deltas)


def test_byte_fallback_tokens_are_used(tmp_path):
    tok_fixtures.save(tok_fixtures.sentencepiece_like(), tmp_path, bos="<s>", eos="</s>")
    tok = Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode("🐍", add_special_tokens=False)
    pieces = [tok.tok.id_to_token(i) for i in ids]
    assert sum(p.startswith("<0x") for p in pieces) == 4  # one emoji = four byte tokens
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    deltas = [detok.add(i) for i in ids]
    assert deltas[-4:] == ["", "", "", "🐍"]  # held back until the character is whole


def test_special_tokens_and_eos(tmp_path):
    tok_fixtures.save(tok_fixtures.byte_level(), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (1, 7)  # generation_config, config and the eos token, merged
    assert tok.encode("hi")[0] == tok.bos_token_id == 0
    assert tok.encode("hi", add_special_tokens=False)[0] != 0
    assert tok.decode(tok.encode("hi there")) == "hi there"


def test_chat_template_matches_transformers(tmp_path):
    tok_fixtures.save(tok_fixtures.byte_level(), tmp_path)
    ours = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi 👋"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "List?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_pretrained(tmp_path)
    tok_fixtures.save(tok_fixtures.byte_level(), tmp_path, template=None)
    with pytest.raises(TokenizerError, match="no chat_template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_batched_deltas_match_the_two_window_rule_with_about_one_decode_a_token(tokenizer):
    """Each delta is what decoding the window before and after the new token gives; the window
    before is remembered, or looked up for a single token, so most tokens take one decode (this text has many multi-token characters)."""
    calls = []
    decode_batch = tokenizer.decode_batch
    tokenizer.decode_batch = lambda windows: calls.append(len(windows)) or decode_batch(windows)
    outs = [tokenizer.encode(t, add_special_tokens=False) for t in TRICKY * 3]
    prompt = tokenizer.encode("Python says:")
    detoks = [IncrementalDetokenizer(tokenizer, prompt) for _ in outs]
    want, got = [[] for _ in outs], [[] for _ in outs]
    state = [(prompt[-5:], 0, len(prompt[-5:])) for _ in outs]  # ids, prefix, read
    for k in range(max(map(len, outs))):
        live = [i for i, o in enumerate(outs) if k < len(o)]
        for i, delta in zip(live, IncrementalDetokenizer.add_many(
                [detoks[i] for i in live], [outs[i][k] for i in live])):
            got[i].append(delta)
            ids, prefix, read = state[i]
            ids = ids + [outs[i][k]]
            before, text = decode_batch([ids[prefix:read]])[0], decode_batch([ids[prefix:]])[0]
            if len(text) <= len(before) or text.endswith("\ufffd"):
                want[i].append("")
            else:
                want[i].append(text[len(before):])
                prefix, read = read, len(ids)
            state[i] = ids, prefix, read
    assert got == want
    assert sum(calls) < 1.5 * sum(map(len, outs))  # two a token without the table
