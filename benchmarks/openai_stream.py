"""A streaming client of the OpenAI-compatible HTTP API for the online load generator, shaped like
the gRPC AsyncClient's `stream` (chunks with `.token_ids`, `.finish_reason`, `.usage`), so one
`send` measures both. Standard library only (http.client on worker threads; the machines the
benchmarks run on may lack an async HTTP client): each stream holds one thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from types import SimpleNamespace


class HttpStatusError(OSError):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


class HttpStreamClient:
    def __init__(self, target: str, *, max_streams: int = 1024):
        host, _, port = target.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.pool = ThreadPoolExecutor(max_streams, thread_name_prefix="http-stream")
        self.model = None

    def get(self, path: str) -> tuple[int, dict]:
        conn = HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"{}")
        finally:
            conn.close()

    def wait_ready(self, timeout: float):
        import time
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.host}:{self.port} not healthy after {timeout} s")
            time.sleep(0.2)
        self.model = self.get("/v1/models")[1]["data"][0]["id"]
        return self

    def _run(self, path: str, body: dict, push, cancelled: threading.Event):
        """On a worker thread: POST, then push each SSE event's JSON (None at the end)."""
        conn = HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                push(HttpStatusError(r.status, r.read().decode(errors="replace")))
                return
            while not cancelled.is_set():
                line = r.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data: "):
                    push(json.loads(line[6:]))
        except Exception as e:  # handed to the caller
            push(e)
        finally:
            conn.close()  # a cancelled stream's connection closes: the server aborts it
            push(None)

    async def stream(self, prompt, *, max_tokens: int, temperature: float = 1.0,
                     ignore_eos: bool = False, **extra):
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        body = dict(model=self.model, max_tokens=max_tokens, temperature=temperature,
                    ignore_eos=ignore_eos, stream=True, stream_options={"include_usage": True},
                    return_token_ids=True, **extra)
        body["messages" if chat else "prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        loop, queue, cancelled = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        push = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)
        loop.run_in_executor(self.pool, self._run, path, body, push, cancelled)
        finish = None
        try:
            while (event := await queue.get()) is not None:
                if isinstance(event, Exception):
                    raise event
                if "error" in event:
                    raise HttpStatusError(500, json.dumps(event["error"]))
                if event.get("usage") and not event["choices"]:
                    finish = finish or SimpleNamespace(token_ids=[], finish_reason="unknown")
                    finish.usage = SimpleNamespace(**{k: v for k, v in event["usage"].items()
                                                      if isinstance(v, int)})
                    continue
                choice = event["choices"][0]
                chunk = SimpleNamespace(token_ids=choice.get("token_ids", []),
                                        finish_reason=choice.get("finish_reason"), usage=None)
                if chunk.finish_reason:
                    finish = chunk  # sent with the usage that follows it
                    continue
                yield chunk
            if finish is not None:
                yield finish
        finally:
            cancelled.set()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.pool.shutdown(wait=False, cancel_futures=True)
