"""A Python client of the pallasite.v1.Generation service: `Client` (blocking) and `AsyncClient`
(asyncio), with the same methods.

    from pallasite.serving.client import Client
    with Client("localhost:50051") as client:
        for chunk in client.stream("Once upon a time", max_tokens=32, temperature=0.8):
            print(chunk.text, end="", flush=True)
        done = client.generate([{"role": "user", "content": "Hi!"}], max_tokens=16)
        print(done.text, done.finish_reason, done.usage)

A prompt is a text, a list of token ids, or a list of chat messages ({"role", "content"} dicts).
Keyword arguments are the fields of pallasite.v1.SamplingParams (temperature, top_k, top_p, min_p,
repetition_penalty, presence_penalty, frequency_penalty, seed, max_tokens, stop, stop_token_ids,
logprobs, ignore_eos). Errors raise grpc.RpcError; `.code()` and `.details()` tell what and why.
"""

from __future__ import annotations

import sys
import time

import grpc

from .proto import SERVICE_NAME, pb, pb_grpc

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}


def make_request(prompt, request_id: str = "", **sampling) -> pb.GenerateRequest:
    sampling = {k: v for k, v in sampling.items() if v is not None}  # None: the default
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        request.messages.messages.extend(pb.ChatMessage(**m) for m in prompt)
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
        request.token_ids.SetInParent()  # an empty list is still a (bad) token_ids prompt
    return request


def _tokenize_request(prompt, add_special_tokens: bool) -> pb.TokenizeRequest:
    if isinstance(prompt, str):
        return pb.TokenizeRequest(text=prompt, add_special_tokens=add_special_tokens)
    return pb.TokenizeRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(**m) for m in prompt]))


def join(responses) -> pb.GenerateResponse:
    """One response from a stream's messages: text and tokens concatenated, the last message's
    finish and stop reasons, usage and timing."""
    whole = pb.GenerateResponse()
    for r in responses:
        whole.text += r.text
        whole.token_ids.extend(r.token_ids)
        whole.logprobs.extend(r.logprobs)
        whole.request_id = r.request_id
        if r.finish_reason:
            whole.finish_reason = r.finish_reason
            whole.usage.CopyFrom(r.usage)
            whole.timing.CopyFrom(r.timing)
            if stop := r.WhichOneof("stop_reason"):
                setattr(whole, stop, getattr(r, stop))
    return whole


def finish_reason(response: pb.GenerateResponse) -> str | None:
    """'stop', 'length', 'abort', or None (not finished)."""
    return FINISH_REASONS.get(response.finish_reason)


def _health():
    """The health stubs, or None where grpcio-health-checking is missing."""
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        return None
    return health_pb2, health_pb2_grpc


class Client:
    """Blocking client. `timeout` (seconds) is each call's default deadline."""

    def __init__(self, target: str, *, timeout: float | None = None, options=()):
        self.timeout = timeout
        self.channel = grpc.insecure_channel(target, options=list(options))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stream(self, prompt, *, timeout: float | None = None, request_id: str = "", **sampling):
        """Yield GenerateResponses as tokens come; closing the iterator early cancels the call."""
        call = self.stub.Generate(make_request(prompt, request_id, **sampling),
                                  timeout=timeout or self.timeout)
        try:
            yield from call
        finally:
            call.cancel()  # no-op once finished

    def generate(self, prompt, *, timeout: float | None = None, request_id: str = "",
                 **sampling) -> pb.GenerateResponse:
        """The whole completion (GenerateUnary)."""
        return self.stub.GenerateUnary(make_request(prompt, request_id, **sampling),
                                       timeout=timeout or self.timeout)

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        response = self.stub.Tokenize(_tokenize_request(prompt, add_special_tokens),
                                      timeout=self.timeout)
        return list(response.token_ids)

    def detokenize(self, token_ids, skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=self.timeout).text

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout)

    def health(self, service: str = SERVICE_NAME) -> str:
        """'SERVING', 'NOT_SERVING', ... as the standard health service reports. Without
        grpcio-health-checking: 'SERVING' once ModelInfo answers (UNAVAILABLE while warming)."""
        stubs = _health()
        if stubs is None:
            self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout or 5)
            return "SERVING"
        health_pb2, health_pb2_grpc = stubs
        response = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_ready(self, timeout: float = 600, poll_s: float = 0.1):
        """Block until the server reports SERVING (it is loading or unreachable until then)."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not SERVING within {timeout:g} s")
            time.sleep(poll_s)
        return self

    def _ready(self) -> bool:
        try:
            return self.health() == "SERVING"
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                return False
        try:  # a server without the health service: ready once ModelInfo answers
            self.model_info()
            return True
        except grpc.RpcError:
            return False

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """asyncio client; create it inside a running event loop."""

    def __init__(self, target: str, *, timeout: float | None = None, options=()):
        self.timeout = timeout
        self.channel = grpc.aio.insecure_channel(target, options=list(options))
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def stream(self, prompt, *, timeout: float | None = None, request_id: str = "",
                     **sampling):
        """Async-iterate GenerateResponses; leaving the loop early cancels the call."""
        call = self.stub.Generate(make_request(prompt, request_id, **sampling),
                                  timeout=timeout or self.timeout)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def generate(self, prompt, *, timeout: float | None = None, request_id: str = "",
                       **sampling) -> pb.GenerateResponse:
        return await self.stub.GenerateUnary(make_request(prompt, request_id, **sampling),
                                             timeout=timeout or self.timeout)

    async def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        response = await self.stub.Tokenize(_tokenize_request(prompt, add_special_tokens),
                                            timeout=self.timeout)
        return list(response.token_ids)

    async def detokenize(self, token_ids, skip_special_tokens: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request, timeout=self.timeout)).text

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout)

    async def health(self, service: str = SERVICE_NAME) -> str:
        stubs = _health()
        if stubs is None:
            await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout or 5)
            return "SERVING"
        health_pb2, health_pb2_grpc = stubs
        response = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self):
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def stream_to_stdout(server: str, prompt, sampling_kwargs: dict, out=sys.stdout,
                     timeout: float | None = None) -> pb.GenerateResponse:
    """`pallasite generate --server HOST:PORT`: print the completion as it comes; returns the
    joined response. A gRPC error becomes a one-line SystemExit naming its status."""
    with Client(server, timeout=timeout) as client:
        parts = []
        try:
            for response in client.stream(prompt, **sampling_kwargs):
                out.write(response.text)
                out.flush()
                parts.append(response)
        except grpc.RpcError as e:
            raise SystemExit(f"pallasite: {server}: {e.code().name}: {e.details()}") from None
    out.write("\n")
    return join(parts)
