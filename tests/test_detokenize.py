"""The text stage: the outputs' text, made after the engine's step."""

import threading

import pytest

import tok_fixtures
from pallasite.model.tokenizer import Tokenizer
from pallasite.serving.detokenize import TextStage, whole_text
from pallasite.serving.engine import RequestOutput
from pallasite.serving.engine_loop import EngineLoop


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(tok_fixtures.byte_level(400), {}, (), None)


def output(rid, ids, finished=False, text=None, stop_reason=None):
    return RequestOutput(rid, ids, text, None, finished, "length" if finished else None,
                         3, 0, 1, 0.0, None, stop_reason=stop_reason)


def texts(outputs, rid):
    return "".join(o.text_delta for o in outputs if o.request_id == rid)


def test_streamed_and_whole_text_match_the_decode(tok):
    """Multi-byte characters split over tokens: each delta waits for whole characters and the
    last one flushes; decoded whole at the end, the text is the same."""
    lead = tok.tok.token_to_id("Ã")  # the byte 0xC3 alone: the start of a character
    prompt = tok.encode("Lists, ")
    ids = tok.encode("héllo wörld — naïve café") + [lead] + tok.encode(" ok") + [lead]
    stage = TextStage(tok)
    stage.start("s", prompt)
    got = []
    for j, t in enumerate(ids):
        got += stage.fill([output("s", [t], j == len(ids) - 1), output("other", [t])])
    whole = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert texts(got, "s") == whole_text(tok, prompt, ids) == whole
    assert whole.endswith("\ufffd ok\ufffd")
    streamed = [o.text_delta for o in got if o.request_id == "s"]
    assert streamed[-1] == "\ufffd" and "" in streamed  # held back, then flushed at the end
    assert {o.text_delta for o in got if o.request_id == "other"} == {None}  # not streamed
    assert not stage.detoks


def test_several_outputs_of_a_request_and_what_the_engine_made(tok):
    """Two outputs of one request in one call: both tokens' text comes with the later one. Text
    the engine made already passes through; a stop token adds no text."""
    stage = TextStage(tok)
    stage.start("a", [1, 2])
    stage.start("b", [1, 2])
    a, b = tok.encode(" quick brown"), tok.encode(" lazy dog")
    got = stage.fill([output("a", a[:1]), output("x", [5], text="kept"), output("a", a[1:]),
                      output("b", b + [7], True, stop_reason=7)])
    assert [o.text_delta for o in got] == ["", "kept", " quick brown", " lazy dog"]
    assert [o.new_token_ids for o in got] == [a[:1], [5], a[1:], b + [7]]
    assert whole_text(tok, [1, 2], b + [7], stop_reason=7) == " lazy dog"
    assert list(stage.detoks) == ["a"]


def test_without_a_tokenizer_streamed_text_is_empty():
    stage = TextStage(None)
    stage.start("s", [1, 2])
    got = stage.fill([output("s", [3]), output("w", [3]), output("s", [4], True)])
    assert [o.text_delta for o in got] == ["", None, ""] and not stage.detoks


class FakeEngine:
    """Gives each request one token a step, `text_delta` None as the engine leaves it."""

    def __init__(self, tokenizer, tokens):
        self.tokenizer, self.tokens, self.live = tokenizer, tokens, {}

    def check_request(self, prompt_ids, sampling):
        pass

    def add_request(self, request_id, prompt_ids, sampling, quiet=False):
        self.live[request_id] = 0

    def abort(self, request_id):
        self.live.pop(request_id, None)

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, j in list(self.live.items()):
            done = j + 1 == len(self.tokens)
            outs.append(output(rid, [self.tokens[j]], done))
            self.live[rid] = j + 1
            if done:
                del self.live[rid]
        return outs


def test_engine_loop_fills_the_streamed_text_only(tok):
    """The loop hands its callbacks the text the engine left out, a step at a time, for the
    requests that stream; the others' outputs carry none."""
    ids = tok.encode(" over the lazy dog")
    loop = EngineLoop(FakeEngine(tok, ids))
    got, done = {"s": [], "w": []}, {"s": threading.Event(), "w": threading.Event()}

    def on_output(rid):
        def put(out):
            got[rid].append(out)
            if out.finished:
                done[rid].set()
        return put
    loop.submit("s", [1, 2, 3], None, on_output("s"))
    loop.submit("w", [1, 2, 3], None, on_output("w"), stream=False)
    assert done["s"].wait(10) and done["w"].wait(10)
    loop.close()
    for rid in ("s", "w"):
        assert [t for o in got[rid] for t in o.new_token_ids] == ids
    assert texts(got["s"], "s") == whole_text(tok, [1, 2, 3], ids)
    assert sum(o.text_delta != "" for o in got["s"]) > 1
    assert {o.text_delta for o in got["w"]} == {None}
