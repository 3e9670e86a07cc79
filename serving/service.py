"""The pallasite.v1.Generation servicer: gRPC calls in, engine requests out.

The engine steps on its own thread (the LLM's EngineLoop). A call submits its request there and
awaits the outputs, which the engine thread hands to the event loop through an `Inbox`, so the
loop never waits on the device. A call that ends early for any reason (cancel, disconnect,
deadline, shutdown) aborts its request, which frees its KV pages at once. Every call ends with
a status code counted in the metrics; each generation writes one JSON log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
import weakref

import grpc

from . import api
from .api import ApiError
from .detokenize import output_text
from .metrics import Metrics
from .proto import pb, pb_grpc
from .scheduler import RequestError

log = logging.getLogger("pallasite.serving.service")
request_log = logging.getLogger("pallasite.serving.requests")
Code = grpc.StatusCode
WARMING, SERVING, DRAINING = "warming", "serving", "draining"
DEADLINE_SLACK_S = 0.1  # a cancel this close to the deadline is the deadline


@dataclasses.dataclass
class Call:
    """One call, as its log line and the metrics see it."""
    method: str
    request_id: str
    client_request_id: str = ""
    peer: str = ""
    received: float = dataclasses.field(default_factory=time.time)
    code: str = "OK"
    message: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_time_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    last_token_at: float | None = None
    shut_down: bool = False  # aborted by the server's shutdown

    def log_line(self) -> str:
        skip = {"received", "last_token_at", "shut_down"}
        record = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        return json.dumps({"event": "request", "time": round(self.received, 3), **record})


class Inbox:
    """Outputs from the engine thread to one event loop's queues, with one wakeup of the loop
    for all that arrive before it runs (`call_soon_threadsafe` writes to the loop's self-pipe:
    a system call an output, 1024 a step at 1024 streams)."""

    _of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop):
        self.loop, self.items, self.lock, self.armed = loop, [], threading.Lock(), False

    @classmethod
    def of(cls, loop) -> "Inbox":
        if loop not in cls._of:
            cls._of[loop] = cls(loop)
        return cls._of[loop]

    def put(self, queue: asyncio.Queue, item):
        with self.lock:
            self.items.append((queue, item))
            if self.armed:
                return
            self.armed = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self):
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class Request:
    """A request submitted to the engine loop: its outputs arrive on an asyncio.Queue, each with
    the time the engine thread handed it over. Without `stream` they carry no text (unless the
    engine made it): `output_text` makes the whole once, at the end; and there are two of them
    (the engine's `quiet` request): the first token, for its timing, and the rest at the end."""

    def __init__(self, engine_loop, request_id: str, prompt_ids, sampling, stream: bool = True):
        self.engine_loop, self.request_id, self.finished = engine_loop, request_id, False
        self.prompt_ids, self.sampling = prompt_ids, sampling
        self.queue: asyncio.Queue = asyncio.Queue()
        inbox = Inbox.of(asyncio.get_running_loop())
        engine_loop.submit(request_id, prompt_ids, sampling,
                           lambda out: inbox.put(self.queue, (out, time.time())),
                           stream=stream, quiet=not stream)

    async def next(self) -> list:
        """The outputs that arrived since the last call (at least one), as (output, time)."""
        batch = [await self.queue.get()]
        while not self.queue.empty():  # a slow reader catches up in one message
            batch.append(self.queue.get_nowait())
        self.finished = batch[-1][0].finished
        return batch

    def close(self):
        if not self.finished:
            self.engine_loop.abort(self.request_id)
            self.finished = True


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, metrics: Metrics, max_queue: int):
        self.metrics, self.max_queue = metrics, max_queue
        self.state, self.llm, self.model_name = WARMING, None, ""
        self.calls: dict[str, Call] = {}  # generation calls under way
        self.queued = 0  # of those, the ones with no token yet

    def ready(self, llm, model_name: str):
        self.llm, self.model_name, self.state = llm, model_name, SERVING

    @property
    def engine(self):
        return self.llm.engine

    # -- the call wrapper: status codes, metrics, the log line ---------------------------------
    @contextlib.asynccontextmanager
    async def _call(self, method: str, context, request=None):
        call = Call(method, uuid.uuid4().hex[:16], peer=context.peer() or "")
        if request is not None and request.request_id:
            call.client_request_id = request.request_id
        try:
            self.check_serving()
            yield call
        except ApiError as e:
            call.code, call.message = e.code.name, e.message
            await context.abort(e.code, e.message)
        except (asyncio.CancelledError, GeneratorExit):
            # The client's own deadline timer may cancel a moment before the server's copy of
            # it runs out (the header is sent after the call starts and rounded up).
            remaining = context.time_remaining()
            late = remaining is not None and remaining < DEADLINE_SLACK_S
            call.code = "DEADLINE_EXCEEDED" if late else "CANCELLED"
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            log.exception("%s %s failed", method, call.request_id)
            call.code, call.message = "INTERNAL", f"{type(e).__name__}: {e}"
            await context.abort(Code.INTERNAL, call.message)
        finally:
            self.metrics.finished(method, call.code)
            if method.startswith("Generate"):
                request_log.info(call.log_line())

    # -- generation ---------------------------------------------------------------------------
    def _submit(self, request: pb.GenerateRequest, call: Call, stream: bool = True) -> Request:
        vocab = self.engine.config.vocab_size
        sampling = api.sampling_params(request.sampling, vocab)
        ids = api.prompt_token_ids(request, self.llm.tokenizer, vocab)
        return self.submit(ids, sampling, call, stream)

    def check_serving(self):
        if self.state != SERVING:
            raise ApiError(Code.UNAVAILABLE, "the model is loading and warming up; retry when "
                           "health reports SERVING" if self.state == WARMING else
                           "the server is shutting down")

    def submit(self, ids: list[int], sampling, call: Call, stream: bool = True) -> Request:
        """Hand a request to the engine (from the event loop); the HTTP front end calls this too."""
        self.check_serving()
        api.check_length(len(ids), sampling, self.engine.max_model_len)
        if self.queued >= self.max_queue:
            raise ApiError(Code.RESOURCE_EXHAUSTED, f"the admission queue is full: {self.queued} "
                           f"requests wait for their first token (limit {self.max_queue}, "
                           "--max-queue); retry later")
        try:
            # LLM keeps the engine loop that its own generate() uses: one engine thread for all.
            req = Request(self.llm._loop, call.request_id, ids, sampling, stream)
        except RequestError as e:
            raise ApiError(Code.INVALID_ARGUMENT, str(e)) from None
        call.prompt_tokens = len(ids)
        self.calls[call.request_id] = call
        self._set_queued(+1)
        self.metrics.in_flight.inc()
        self.metrics.prompt_tokens.inc(len(ids))
        return req

    def _release(self, call: Call, req: Request):
        req.close()
        self.calls.pop(call.request_id, None)
        if call.ttft_s is None:
            self._set_queued(-1)
        self.metrics.in_flight.dec()

    def _set_queued(self, delta: int):
        self.queued += delta
        self.metrics.queue_depth.set(self.queued)

    def _observe(self, call: Call, batch) -> None:
        """Timing and token metrics of the outputs that just arrived."""
        m = self.metrics
        for out, at in batch:
            n = len(out.new_token_ids)
            if n and call.ttft_s is None:
                call.ttft_s = (out.first_token_time or at) - call.received
                started = getattr(out, "scheduled_time", None) or out.arrival_time
                call.queue_time_s = max(0.0, started - call.received)
                m.ttft.observe(call.ttft_s)
                m.queue_time.observe(call.queue_time_s)
                self._set_queued(-1)
            elif n:
                for _ in range(n):
                    m.itl.observe((at - call.last_token_at) / n)
            if n:
                call.last_token_at = at
                call.completion_tokens += n  # so far, should the call end early
                m.generated_tokens.inc(n)
            if out.finished:
                call.finish_reason, call.cached_tokens = out.finish_reason, out.cached_tokens
                call.completion_tokens, call.e2e_s = out.completion_tokens, at - call.received
                m.e2e.observe(call.e2e_s)

    def _final(self, call: Call, response: pb.GenerateResponse, last, sampling):
        """Complete the last message, or raise if the abort was not the caller's doing."""
        if last.finish_reason == "abort" and self.llm._loop.error is not None:
            raise ApiError(Code.INTERNAL, f"the engine failed: {self.llm._loop.error!r}")
        if last.finish_reason == "abort" and call.shut_down:
            raise ApiError(Code.UNAVAILABLE, "the server shut down before the request finished")
        timing = dict(queue_time_s=call.queue_time_s or 0.0, ttft_s=call.ttft_s or 0.0,
                      e2e_s=call.e2e_s or 0.0)
        return api.finish(response, last, timing, sampling.reported_stop(last.stop_reason))

    def _response(self, call: Call, req: Request, outputs) -> pb.GenerateResponse:
        response = api.add_outputs(pb.GenerateResponse(request_id=call.client_request_id
                                                       or call.request_id), outputs)
        if not outputs[-1].finished:
            return response
        return self._final(call, response, outputs[-1], req.sampling)

    async def Generate(self, request, context):
        async with self._call("Generate", context, request) as call:
            req = self._submit(request, call)
            try:
                while not req.finished:
                    batch = await req.next()
                    self._observe(call, batch)
                    yield self._response(call, req, [out for out, _ in batch])
            finally:
                self._release(call, req)

    async def GenerateUnary(self, request, context):
        async with self._call("GenerateUnary", context, request) as call:
            req, outputs = self._submit(request, call, stream=False), []
            try:
                while not req.finished:
                    batch = await req.next()
                    self._observe(call, batch)
                    outputs += [out for out, _ in batch]
            finally:
                self._release(call, req)
            response = self._response(call, req, outputs)
            response.text = output_text(self.llm.tokenizer, req.prompt_ids, outputs)
            return response

    def abort_all(self):
        """Shutdown: abort every generation under way (each call then ends UNAVAILABLE)."""
        for call in list(self.calls.values()):
            call.shut_down = True
            self.llm._loop.abort(call.request_id)

    # -- tokens and model ---------------------------------------------------------------------
    async def Tokenize(self, request, context):
        async with self._call("Tokenize", context):
            tokenizer = self.llm.tokenizer
            if request.WhichOneof("input") == "messages":
                ids = api.chat_token_ids(tokenizer, request.messages)
            else:
                api.need_tokenizer(tokenizer, "Tokenize needs one")
                special = request.add_special_tokens if request.HasField(
                    "add_special_tokens") else True
                ids = tokenizer.encode(request.text, add_special_tokens=special)
            return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context):
        async with self._call("Detokenize", context):
            api.need_tokenizer(self.llm.tokenizer, "Detokenize needs one")
            api.check_token_ids("token_ids", request.token_ids, self.engine.config.vocab_size)
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            text = self.llm.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
            return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request, context):
        async with self._call("ModelInfo", context):
            e, tokenizer = self.engine, self.llm.tokenizer
            import jax  # already loaded by the engine
            return pb.ModelInfoResponse(
                model_name=self.model_name, context_length=e.max_model_len,
                vocab_size=e.config.vocab_size, dtype=str(jax.tree.leaves(e.params)[0].dtype),
                mesh=describe_mesh(e), eos_token_ids=sorted(e.eos),
                has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
                max_num_seqs=e.max_num_seqs, kv_pages=e.pages.num_pages, page_size=e.page_size,
                quantization=describe_quantization(getattr(e, "params", None) or e.replicas[0].params),
                kv_cache_dtype=str(e.kv_cache_dtype),
                speculative=e.spec.config.describe() if getattr(e, "spec", None) else "")


def describe_quantization(params) -> str:
    from ..model.quant_int import describe
    return describe(params)


def describe_mesh(engine) -> str:
    layout = getattr(engine, "layout", None)  # set when the engine runs on a device mesh
    mesh = getattr(layout, "mesh", None)
    if mesh is not None:
        return " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    import jax
    return f"1 device ({jax.devices()[0].device_kind})"
