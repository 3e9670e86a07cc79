"""The text of the engine's outputs, made after the step instead of inside it.

The engine turns tokens into text only where it must read the text itself (a request with stop
strings). Every other output leaves `Engine.step()` with `text_delta` None. A TextStage fills
in the text of requests that stream it, one batched detokenization over a step's outputs; a
request that takes its text whole (`LLM.generate`, unary gRPC, HTTP without streaming) decodes
it once, at its end (`output_text`), and costs no step anything.
"""

from __future__ import annotations

from itertools import repeat

from ..model.tokenizer import IncrementalDetokenizer

_new = tuple.__new__  # an output with its text: built as a plain tuple (RequestOutput's order)


class TextStage:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.detoks: dict[str, IncrementalDetokenizer | None] = {}  # None: no tokenizer

    def start(self, request_id: str, prompt_ids: list[int]):
        """A request that streams its text: it begins after `prompt_ids` (the last few give the
        context); without a tokenizer its text is "". Any other request's outputs pass through
        `fill` untouched."""
        self.detoks[request_id] = (None if self.tokenizer is None else
                                   IncrementalDetokenizer(self.tokenizer, prompt_ids))

    def fill(self, outputs: list) -> list:
        """`outputs` (RequestOutputs, in the order the engine made them) with the text of the
        streaming requests filled in; a finished request's state is dropped. The outputs are
        taken apart into columns and built again in bulk: a step has one per running request."""
        detoks = self.detoks
        if not detoks:  # no request streams its text: nothing to read through
            return outputs
        todo = [out for out in outputs if out.text_delta is None and out.request_id in detoks]
        if todo:
            cols = list(zip(*todo))  # request_id, new_token_ids, text_delta, ... (RequestOutput)
            cols[2] = self._deltas(cols[0], cols[1], cols[4], cols[-1])
            made = map(_new, repeat(type(todo[0])), zip(*cols))
            outputs = list(made) if len(todo) == len(outputs) else [
                next(made) if out.text_delta is None and out.request_id in detoks else out
                for out in outputs]
        for request_id in [out.request_id for out in outputs if out.finished]:
            detoks.pop(request_id, None)
        return outputs

    def _deltas(self, request_ids, new_ids, finished, stop_reasons) -> list[str]:
        """Each output's new text, all decoded in one batch; where a request has several
        outputs here, all their text comes with its last one."""
        if self.tokenizer is None:
            return [""] * len(new_ids)
        ids, rows = _text_ids(new_ids, stop_reasons), range(len(new_ids))
        unique = len(set(request_ids)) == len(request_ids)
        if unique and all(ids):  # the common step: a token for each request
            return IncrementalDetokenizer.add_many(
                list(map(self.detoks.__getitem__, request_ids)), ids, finished)
        if not unique:
            last = {}
            for k, request_id in enumerate(request_ids):
                if request_id in last:
                    j = last[request_id]
                    ids[k], ids[j] = ids[j] + ids[k], []
                last[request_id] = k
            rows = last.values()
        rows = [k for k in rows if ids[k] or finished[k]]
        return _place(len(ids), rows, IncrementalDetokenizer.add_many(
            [self.detoks[request_ids[k]] for k in rows], [ids[k] for k in rows],
            [finished[k] for k in rows]))


def whole_text(tokenizer, prompt_ids: list[int], token_ids: list[int], stop_reason=None) -> str:
    """The text of a request's output tokens decoded at once, as the streamed deltas add up."""
    d = IncrementalDetokenizer(tokenizer, prompt_ids)
    return IncrementalDetokenizer.add_many([d], _text_ids([token_ids], [stop_reason]), [True])[0]


def output_text(tokenizer, prompt_ids: list[int], outputs) -> str:
    """The whole text of a request's outputs, however it was made: the engine's own where it
    made it (stop strings), else its tokens decoded once."""
    if tokenizer is None or all(out.text_delta is not None for out in outputs):
        return "".join(out.text_delta or "" for out in outputs)
    return whole_text(tokenizer, prompt_ids, [t for out in outputs for t in out.new_token_ids],
                      outputs[-1].stop_reason if outputs else None)


def _text_ids(new_ids, stop_reasons) -> list[list[int]]:
    """The tokens that make text: all but a stop token that ended a request."""
    return [ids[:-1] if type(why) is int else ids for ids, why in zip(new_ids, stop_reasons)]


def _place(n: int, rows, texts) -> list[str]:
    out = [""] * n
    for k, text in zip(rows, texts):
        out[k] = text
    return out
