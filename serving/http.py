"""The OpenAI-compatible HTTP front end (FastAPI, served by uvicorn on the gRPC server's loop).

    POST /v1/completions, POST /v1/chat/completions (SSE with "stream": true), GET /v1/models,
    GET /health (503 while loading or draining), GET /metrics (the gRPC server's registry)

It shares the GenerationService with gRPC: the same engine loop, admission queue limit, drain
and metrics. Each choice (a prompt times `n`) is one engine request; for n > 1 the first goes
alone and the others follow once it has its first token, so they find the prompt's full pages in
the prefix cache. A stream whose client goes away aborts its requests, which frees their pages.
Errors are OpenAI error objects with the HTTP status of their cause.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import grpc
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import api
from .api import ApiError
from .detokenize import output_text
from .openai_schema import (ChatRequest, CompletionRequest, FieldError, flatten_messages,
                            tool_constraint)
from .scheduler import RequestError
from .service import Call, GenerationService, SERVING

log = logging.getLogger("pallasite.serving.http")
request_log = logging.getLogger("pallasite.serving.requests")
STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
          grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500}
ERROR_TYPE = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
              503: "service_unavailable", 500: "internal_error"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(self.status, "error"),
                          "param": self.param, "code": self.status}}

    @classmethod
    def of(cls, e: Exception) -> "HttpError":
        if isinstance(e, HttpError):
            return e
        if isinstance(e, FieldError):
            return cls(400, str(e), e.param)
        if isinstance(e, ApiError):
            return cls(STATUS.get(e.code, 500), e.message)
        if isinstance(e, (RequestError, ValueError)):
            return cls(400, str(e))
        return cls(500, f"{type(e).__name__}: {e}")


def create_app(service: GenerationService) -> FastAPI:
    app = FastAPI(title="pallasite", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HttpError)
    async def _http_error(_, e: HttpError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if x != "body")
        return JSONResponse(HttpError(400, f"{loc}: {err['msg']}", loc or None).body(), 400)

    @app.get("/health")
    async def health():
        ok = service.state == SERVING
        return JSONResponse({"status": service.state}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        guard(service)
        return {"object": "list", "data": [{
            "id": service.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "pallasite", "max_model_len": service.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await Generation(service, "Completions", body, http).run()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HttpRequest):
        return await Generation(service, "ChatCompletions", body, http).run()

    return app


def guard(service: GenerationService):
    try:
        service.check_serving()
    except ApiError as e:
        raise HttpError.of(e) from None


class Generation:
    """One completions or chat call: its prompts, its choices' engine requests, its response."""

    def __init__(self, service: GenerationService, method: str, body, http: HttpRequest):
        self.service, self.method, self.body, self.http = service, method, body, http
        self.chat = method == "ChatCompletions"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tool_name = self.tool_any = None
        self.calls: list[Call] = []
        self.requests: list = []
        self.prompts: list[list[int]] = []

    # -- request ------------------------------------------------------------------------------
    async def run(self):
        try:
            guard(self.service)
            if self.body.model != self.service.model_name:
                raise HttpError(404, f"the model {self.body.model!r} does not exist; this server "
                                f"serves {self.service.model_name!r} (GET /v1/models)", "model")
            self.sampling = await self._prepare()
            if self.body.stream:
                first = self._submit_all()
                return StreamingResponse(self._sse(first), media_type="text/event-stream")
            first = self._submit_all()
            return JSONResponse(await self._whole(first))
        except Exception as e:
            self._release()
            err = HttpError.of(e)
            if err.status == 500:
                log.exception("%s failed", self.method)
            self._log(err)
            return JSONResponse(err.body(), status_code=err.status)

    async def _prepare(self):
        """Prompt ids and SamplingParams for every prompt; the grammar compiled off the loop."""
        body, tokenizer = self.body, self.service.llm.tokenizer
        vocab = self.service.engine.config.vocab_size
        structured, field = body.structured()
        if self.chat:
            tool, self.tool_name = tool_constraint(body.tools, body.tool_choice)
            if tool is not None and structured is not None:
                raise FieldError("tool_choice", f"tool_choice and {field} both constrain the output")
            if tool is not None:
                structured, field = tool, "tools"
                self.tool_any = self.tool_name is None
            if body.top_logprobs is not None and not body.logprobs:
                raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            max_tokens = body.max_completion_tokens or body.max_tokens
            self.prompts = [self._chat_ids(tokenizer)]
            default_max = None
        else:
            body.refuse_unsupported()
            logprobs, max_tokens, default_max = body.logprobs, body.max_tokens, 16
            self.prompts = self._completion_ids(tokenizer, vocab)
        sp = body.sampling(max_tokens, logprobs, default_max, structured)
        guide = getattr(self.service.engine, "guide", None)
        if guide is not None and (structured is not None or sp.logit_bias):
            try:
                await asyncio.to_thread(guide.check, sp)  # compiles (then cached) off the loop
            except ValueError as e:
                raise FieldError(field or "logit_bias", f"{field or 'logit_bias'}: {e}") from None
        for ids in self.prompts:
            try:
                api.check_length(len(ids), sp, self.service.engine.max_model_len)
            except ApiError as e:
                raise FieldError("max_tokens" if "max_tokens" in e.message else "prompt",
                                 e.message.replace("sampling.", "")) from None
        return sp

    def _chat_ids(self, tokenizer) -> list[int]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise FieldError("messages", "this model has no chat template; use /v1/completions")
        if not self.body.messages:
            raise FieldError("messages", "messages is empty; it needs at least 1 message")
        kwargs = dict(self.body.chat_template_kwargs or {})
        if self.body.tools:
            kwargs["tools"] = self.body.tools
        try:
            text = tokenizer.apply_chat_template(flatten_messages(self.body.messages),
                                                 add_generation_prompt=True, **kwargs)
        except ValueError as e:  # the template's raise_exception
            raise FieldError("messages", f"messages: {e}") from None
        return tokenizer.encode(text, add_special_tokens=False)

    def _completion_ids(self, tokenizer, vocab: int) -> list[list[int]]:
        prompt = self.body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            prompt = [prompt]
        if not prompt:
            raise FieldError("prompt", "prompt is empty")
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                if tokenizer is None:
                    raise FieldError("prompt", "this model has no tokenizer: send token ids")
                ids = tokenizer.encode(p)
            else:
                ids = list(p)
                for t in ids:
                    if not 0 <= t < vocab:
                        raise FieldError("prompt", f"prompt[{i}] holds {t}, not a token id "
                                         f"(vocab_size {vocab})")
            if not ids:
                raise FieldError("prompt", f"prompt[{i}] is empty; it needs at least 1 token")
            out.append(ids)
        return out

    # -- engine requests ----------------------------------------------------------------------
    def _choice_sampling(self, j: int):
        sp = self.sampling
        if j == 0 or sp.seed is None:
            return sp
        import dataclasses
        return dataclasses.replace(sp, seed=sp.seed + j)  # n seeded choices, not n copies

    def _submit(self, index: int):
        prompt = self.prompts[index // self.body.n]
        call = Call(self.method, uuid.uuid4().hex[:16], client_request_id=self.id,
                    peer=self.http.client.host if self.http.client else "")
        req = self.service.submit(prompt, self._choice_sampling(index % self.body.n), call,
                                  stream=bool(self.body.stream))
        self.calls[index], self.requests[index] = call, req
        return req

    def _submit_all(self):
        """Submit each prompt's first choice now; the others wait for it (prefix sharing).
        Returns an asyncio.Queue of (choice index, [outputs]) for every choice."""
        total = len(self.prompts) * self.body.n
        self.calls, self.requests = [None] * total, [None] * total
        merged: asyncio.Queue = asyncio.Queue()
        self._tasks = []
        for p in range(len(self.prompts)):
            self._submit(p * self.body.n)
        for p in range(len(self.prompts)):
            self._tasks.append(asyncio.create_task(self._pump(p * self.body.n, merged)))
        return merged

    async def _pump(self, first: int, merged: asyncio.Queue):
        """Forward one prompt's choices' outputs to `merged`; start its other choices after the
        first one's first output."""
        started = False
        pending = {first: self.requests[first]}
        waiting = {}
        try:
            while pending:
                waiting.update({i: asyncio.ensure_future(r.next()) for i, r in pending.items()
                                if i not in waiting})
                done, _ = await asyncio.wait(waiting.values(), return_when=asyncio.FIRST_COMPLETED)
                for i in [i for i, f in waiting.items() if f in done]:
                    batch = waiting.pop(i).result()
                    self.service._observe(self.calls[i], batch)
                    merged.put_nowait((i, [out for out, _ in batch]))
                    if self.requests[i].finished:
                        pending.pop(i)
                if not started:
                    started = True
                    for j in range(first + 1, first + self.body.n):
                        try:
                            pending[j] = self._submit(j)
                        except Exception as e:
                            merged.put_nowait((j, e))
        finally:
            for f in waiting.values():
                f.cancel()

    def _release(self):
        for t in getattr(self, "_tasks", ()):
            t.cancel()
        for call, req in zip(self.calls, self.requests):
            if req is not None:
                self.service._release(call, req)
        self.calls, self.requests = [], []

    def _log(self, err: HttpError | None = None):
        self.service.metrics.finished(self.method, "OK" if err is None else str(err.status))
        if err is not None:
            request_log.info(json.dumps({"event": "request", "method": self.method,
                                         "id": self.id, "status": err.status,
                                         "message": err.message}))
        for call in self.calls:
            if call is not None:
                request_log.info(call.log_line())

    async def _outputs(self, merged: asyncio.Queue):
        """(choice index, outputs) until every choice has finished."""
        left = len(self.calls)
        while left:
            i, outs = await merged.get()
            if isinstance(outs, Exception):
                raise outs
            for out in outs:
                if out.finished and out.finish_reason == "abort":
                    self._check_abort(i)
            yield i, outs
            left -= bool(outs and outs[-1].finished)

    def _check_abort(self, i: int):
        if self.service.llm._loop.error is not None:
            raise HttpError(500, f"the engine failed: {self.service.llm._loop.error!r}")
        if self.calls[i].shut_down:
            raise HttpError(503, "the server shut down before the request finished")

    # -- responses ----------------------------------------------------------------------------
    async def _whole(self, merged) -> dict:
        n = len(self.calls)
        got = [[] for _ in range(n)]  # each choice's outputs
        try:
            async for i, outs in self._outputs(merged):
                got[i] += outs
        finally:
            self._release()
        tokenizer, last = self.service.llm.tokenizer, [outs[-1] for outs in got]
        choices = [self._choice(i, output_text(tokenizer, self.prompts[i // self.body.n], outs),
                                [lp for o in outs for lp in o.logprobs or []], last[i])
                   for i, outs in enumerate(got)]
        if self.body.return_token_ids:
            for choice, outs in zip(choices, got):
                choice["token_ids"] = [t for o in outs for t in o.new_token_ids]
        self._log()
        return self._object(choices, usage=self._usage(last))

    def _object(self, choices, usage="omit", chunk=False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        obj = {"id": self.id, "object": kind, "created": self.created, "model": self.body.model,
               "choices": choices}
        if usage != "omit":
            obj["usage"] = usage
        return obj

    def _finish_reason(self, out) -> str | None:
        if out is None or not out.finished:
            return None
        if self.tool_name is not None or self.tool_any:
            return "tool_calls" if out.finish_reason == "stop" else out.finish_reason
        return out.finish_reason

    def _choice(self, i: int, text: str, lps, out) -> dict:
        want = self.sampling.logprobs is not None
        stop = self.sampling.reported_stop(out.stop_reason)  # vLLM's extra field
        if not self.chat:
            return {"index": i, "text": text, "finish_reason": self._finish_reason(out),
                    "logprobs": self._completion_logprobs(lps) if want else None,
                    "stop_reason": stop}
        message = {"role": "assistant", "content": text}
        if self.tool_name is not None or self.tool_any:
            message = {"role": "assistant", "content": None, "tool_calls": [self._tool_call(text)]}
        return {"index": i, "message": message, "finish_reason": self._finish_reason(out),
                "logprobs": {"content": self._chat_logprobs(lps)} if want else None,
                "stop_reason": stop}

    def _tool_call(self, text: str) -> dict:
        name, arguments = self.tool_name, text
        if self.tool_any:  # {"name": ..., "arguments": {...}}
            try:
                value = json.loads(text)
                name, arguments = value["name"], json.dumps(value["arguments"])
            except (ValueError, KeyError, TypeError):
                name = None
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _token(self, t: int) -> str:
        tok = self.service.llm.tokenizer
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    def _completion_logprobs(self, lps) -> dict:
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(t): p for t, p in lp.top} for lp in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, lps) -> list[dict]:
        def entry(t, p):
            s = self._token(t)
            return {"token": s, "logprob": p, "bytes": list(s.encode())}
        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                for lp in lps]

    def _usage(self, last) -> dict:
        n = self.body.n
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(out.completion_tokens for out in last if out is not None)
        cached = sum(max((out.cached_tokens for out in last[p * n:(p + 1) * n] if out), default=0)
                     for p in range(len(self.prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _sse(self, merged):
        usage_on = bool(self.body.stream_options and self.body.stream_options.include_usage)
        extra = {"usage": None} if usage_on else {}
        n = len(self.calls)
        last, texts = [None] * n, [""] * n
        event = lambda obj: f"data: {json.dumps(obj)}\n\n"
        err = None
        try:
            if self.chat:
                for i in range(n):
                    yield event({**self._object([{"index": i, "delta": {"role": "assistant",
                                                                        "content": ""},
                                                  "logprobs": None, "finish_reason": None}],
                                                chunk=True), **extra})
            async for i, outs in self._outputs(merged):
                text = "".join(o.text_delta for o in outs)
                lps = [lp for o in outs for lp in o.logprobs or []]
                last[i] = outs[-1]
                texts[i] += text
                delta = self._delta(i, text, lps, outs[-1], texts[i])
                if self.body.return_token_ids:
                    delta["token_ids"] = [t for o in outs for t in o.new_token_ids]
                yield event({**self._object([delta], chunk=True), **extra})
            if usage_on:
                yield event({**self._object([], chunk=True), "usage": self._usage(last)})
        except (HttpError, ApiError) as e:
            err = HttpError.of(e)
            yield event(err.body())
        finally:  # also when the client went away: the requests are aborted, pages freed
            self._release()
            self._log(err)
        yield "data: [DONE]\n\n"

    def _delta(self, i: int, text: str, lps, out, whole: str) -> dict:
        want = self.sampling.logprobs is not None
        reason = self._finish_reason(out)
        stop = self.sampling.reported_stop(out.stop_reason) if out.finished else None
        if not self.chat:
            return {"index": i, "text": text, "finish_reason": reason,
                    "logprobs": self._completion_logprobs(lps) if want else None,
                    "stop_reason": stop}
        delta = {"content": text} if text else {}
        if self.tool_name is not None or self.tool_any:  # the call goes out whole, at the end
            delta = {"tool_calls": [{"index": 0, **self._tool_call(whole)}]} if out.finished else {}
        return {"index": i, "delta": delta, "finish_reason": reason,
                "logprobs": {"content": self._chat_logprobs(lps)} if want else None,
                "stop_reason": stop}
