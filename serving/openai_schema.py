"""The OpenAI request bodies the HTTP front end accepts (pydantic), and how their fields become
prompts and SamplingParams. Unknown fields are ignored, as OpenAI's own server does with fields
it has retired; fields pallasite cannot honour (echo, suffix, best_of > 1) are refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .llm import SamplingParams
from .structured import StructuredOutput, StructuredOutputError


class FieldError(ValueError):
    """A request field that cannot be served; `param` names it (OpenAI's error.param)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Common(BaseModel):
    """Fields of both endpoints."""
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # llguidance's Lark syntax
    return_token_ids: bool = False  # each choice (and chunk) carries its token ids, as vLLM's

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """The structured-output request, if any, and the field that asked for it."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", dict(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise FieldError("response_format", "response_format.json_schema.schema is "
                                 "required when type is json_schema")
            asked.append(("response_format", dict(json_schema=rf.json_schema.schema_)))
        for field, key in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                asked.append((field, {key: getattr(self, field)}))
        if len(asked) > 1:
            raise FieldError(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the "
                             "output; set one")
        if not asked:
            return None, None
        field, kwargs = asked[0]
        try:
            return StructuredOutput(**kwargs), field
        except StructuredOutputError as e:
            raise FieldError(field, f"{field}: {e}") from None

    def sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int | None,
                 structured: StructuredOutput | None) -> SamplingParams:
        if self.logit_bias is not None:
            try:
                bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except ValueError:
                raise FieldError("logit_bias", "logit_bias keys must be token ids") from None
        kwargs = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                      presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if kwargs.get("top_k") == -1:  # vLLM's "off"
            kwargs["top_k"] = 0
        try:
            return SamplingParams(
                **kwargs, seed=self.seed, max_tokens=max_tokens or default_max,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                logprobs=logprobs, logit_bias=bias if self.logit_bias else None,
                structured_output=structured)
        except ValueError as e:  # "SamplingParams.<field> must be ..."
            text = str(e).replace("SamplingParams.", "")
            raise FieldError(text.split(" ", 1)[0], text) from None


class CompletionRequest(Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self):
        if self.echo:
            raise FieldError("echo", "echo is not supported")
        if self.suffix:
            raise FieldError("suffix", "suffix (insertion) is not supported")
        if self.best_of not in (None, 1, self.n):
            raise FieldError("best_of", "best_of other than n is not supported")


class ChatRequest(Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def flatten_messages(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: content parts joined into one text (only text parts)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise FieldError(f"messages[{i}]", f"messages[{i}] needs a role")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise FieldError(f"messages[{i}].content",
                                     f"messages[{i}].content: only text parts are supported")
                texts.append(part.get("text", ""))
            m["content"] = "".join(texts)
        for call in m.get("tool_calls") or ():  # templates index arguments as a mapping
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
        out.append(m)
    return out


def tool_constraint(tools: list[dict] | None, tool_choice) -> tuple[StructuredOutput | None, str | None]:
    """For tool_choice "required" or a named function: the JSON the output must be, and the
    function's name (None for "required": the output names it, {"name": ..., "arguments": ...})."""
    if tool_choice in (None, "none", "auto"):
        return None, None
    if not tools:
        raise FieldError("tool_choice", "tool_choice needs tools")
    functions = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(fn, dict) or "name" not in fn:
            raise FieldError(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', "
                             "'function': {'name': ..., 'parameters': {...}}}")
        functions[fn["name"]] = fn.get("parameters") or {"type": "object"}
    if tool_choice == "required":
        options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for name, params in functions.items()]
        return StructuredOutput(json_schema={"anyOf": options}), None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise FieldError("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return StructuredOutput(json_schema=functions[name]), name
    raise FieldError("tool_choice", "tool_choice must be none, auto, required or "
                     "{'type': 'function', 'function': {'name': ...}}")
