"""Between the pallasite.v1 messages and the engine: a GenerateRequest becomes prompt token ids
and SamplingParams, or an ApiError whose message names the field and the limit; RequestOutputs
become GenerateResponses."""

from __future__ import annotations

import grpc

from .llm import SamplingParams
from .structured import StructuredOutput, StructuredOutputError
from .proto import pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Optional scalar fields of pb.SamplingParams, passed on only when set (else the library default).
OPTIONAL_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed", "max_tokens", "logprobs")
FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                  "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class ApiError(Exception):
    """Ends a call with `code` and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


# -- requests ---------------------------------------------------------------------------------
def structured_output(msg: pb.SamplingParams) -> StructuredOutput | None:
    if not msg.HasField("structured_output"):
        return None
    so = msg.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ApiError(INVALID, "sampling.structured_output is set but empty: set one of "
                                "json_schema, json_object, regex, choice, grammar")
    value = list(so.choice.options) if kind == "choice" else getattr(so, kind)
    try:
        return StructuredOutput(**{kind: value})
    except StructuredOutputError as e:
        raise ApiError(INVALID, f"sampling.structured_output.{kind}: {e}") from None


def sampling_params(msg: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    kwargs = {f: getattr(msg, f) for f in OPTIONAL_SAMPLING if msg.HasField(f)}
    try:
        sp = SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                            ignore_eos=msg.ignore_eos, logit_bias=dict(msg.logit_bias) or None,
                            structured_output=structured_output(msg), **kwargs)
    except ValueError as e:  # its message names the field and the rule
        raise ApiError(INVALID, str(e).replace("SamplingParams.", "sampling.")) from None
    check_token_ids("sampling.stop_token_ids", sp.stop_token_ids, vocab_size)
    return sp


def check_token_ids(field: str, ids, vocab_size: int):
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ApiError(INVALID, f"{field}[{i}] = {t} is not a token id: the vocabulary has "
                                    f"{vocab_size} tokens (ids 0..{vocab_size - 1})")


def need_tokenizer(tokenizer, what: str):
    if tokenizer is None:
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       f"this model has no tokenizer (no tokenizer.json): {what}")


def chat_token_ids(tokenizer, messages: pb.ChatMessages) -> list[int]:
    """Render the chat template (generation prompt on) and encode it; the template writes any
    BOS itself."""
    need_tokenizer(tokenizer, "send the prompt as token_ids")
    if not messages.messages:
        raise ApiError(INVALID, "messages is empty; the prompt needs at least 1 message")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                       "this model has no chat template; send text or token_ids")
    chat = [{"role": m.role, "content": m.content} for m in messages.messages]
    try:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    except ValueError as e:  # the template rejected the conversation (raise_exception)
        raise ApiError(INVALID, f"messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_token_ids(request: pb.GenerateRequest, tokenizer, vocab_size: int) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ApiError(INVALID, "the prompt is empty: set text, token_ids or messages")
    if kind == "text":
        if not request.text:
            raise ApiError(INVALID, "text is empty; the prompt needs at least 1 character")
        need_tokenizer(tokenizer, "send the prompt as token_ids")
        return tokenizer.encode(request.text)
    if kind == "messages":
        return chat_token_ids(tokenizer, request.messages)
    ids = list(request.token_ids.ids)
    if not ids:
        raise ApiError(INVALID, "token_ids is empty; the prompt needs at least 1 token")
    check_token_ids("token_ids", ids, vocab_size)
    return ids


def check_length(num_prompt: int, sp: SamplingParams, max_model_len: int):
    if num_prompt >= max_model_len:
        raise ApiError(INVALID, f"the prompt has {num_prompt} tokens but the context length is "
                                f"{max_model_len}, which must leave room for 1 generated token")
    if sp.max_tokens is not None and num_prompt + sp.max_tokens > max_model_len:
        raise ApiError(INVALID, f"prompt ({num_prompt} tokens) + sampling.max_tokens "
                                f"({sp.max_tokens}) = {num_prompt + sp.max_tokens} exceeds the "
                                f"context length {max_model_len}")


# -- responses --------------------------------------------------------------------------------
def add_outputs(response: pb.GenerateResponse, outputs):
    """Append the outputs' text, tokens and logprobs to `response`."""
    for out in outputs:
        response.text += out.text_delta or ""  # None: made whole at the end (unary)
        response.token_ids.extend(out.new_token_ids)
        for lp in out.logprobs or ():
            response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
    return response


def finish(response: pb.GenerateResponse, last, timing: dict, stop=None):
    """Fill the final message's finish reason, stop reason (`stop`: a stop string or token id,
    as `SamplingParams.reported_stop` gives it), usage and timing from the last output."""
    response.finish_reason = FINISH_REASONS[last.finish_reason]
    if isinstance(stop, str):
        response.stop_string = stop
    elif stop is not None:
        response.stop_token_id = stop
    response.usage.prompt_tokens = last.prompt_tokens
    response.usage.cached_tokens = last.cached_tokens
    response.usage.completion_tokens = last.completion_tokens
    response.usage.speculative_proposed_tokens = last.spec_proposed
    response.usage.speculative_accepted_tokens = last.spec_accepted
    response.timing.CopyFrom(pb.Timing(**timing))
    return response
