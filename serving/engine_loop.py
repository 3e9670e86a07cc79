"""A thread that drives an Engine, so that any thread can submit and abort requests.

The engine itself is single-threaded: only the loop's thread touches it. Other threads hand it
commands through a queue. After each step the loop makes the text of the requests that
stream it (detokenize.py) and hands each request's outputs to its `on_output` callback, called
on the loop's thread (keep callbacks short: they delay the next step).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from .detokenize import TextStage
from .engine import Engine, RequestOutput
from .scheduler import RequestError

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._cond = threading.Condition()
        self._commands: deque = deque()
        self._callbacks: dict[str, callable] = {}
        self._closing = False
        self.text = TextStage(engine.tokenizer)
        self._thread = threading.Thread(target=self._run, name="pallasite-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], sampling, on_output,
               stream: bool = True, quiet: bool = False):
        """Queue a request. Raises RequestError here, in the caller's thread, if it cannot be
        served. Without `stream` its outputs carry no text (`text_delta` None) unless the
        engine made it (stop strings): the caller decodes the whole once (`whole_text`).
        `quiet` (with `stream` off): two outputs, its first token and the rest as it ends
        (`Engine.add_request`)."""
        self.engine.check_request(prompt_ids, sampling)
        with self._cond:
            if self.error is not None or self._closing:
                raise RuntimeError("the engine loop has stopped") from self.error
            if request_id in self._callbacks:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._callbacks[request_id] = on_output
            self._commands.append(("add", request_id, list(prompt_ids), sampling, stream,
                                   quiet and not stream))
            self._cond.notify()

    def abort(self, request_id: str):
        with self._cond:
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def reset_prefix_cache(self) -> bool:
        """`Engine.reset_prefix_cache` on the loop's thread; False while requests run."""
        done, result = threading.Event(), []

        def reset():  # on the loop's thread, between steps
            result.append(self.engine.reset_prefix_cache())
            done.set()
        with self._cond:
            if self.error is not None or self._closing:
                raise RuntimeError("the engine loop has stopped") from self.error
            self._commands.append(("reset", reset))
            self._cond.notify()
        while not done.wait(0.05):
            if self.error is not None:
                raise RuntimeError("the engine loop has stopped") from self.error
        return result[0]

    def close(self):
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _run(self):
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._closing or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._closing:
                        return
                    commands, self._commands = self._commands, deque()
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished():
                    self._deliver(*self.text.fill(self.engine.step()))
        except BaseException as e:  # the engine broke: tell every waiting request, then stop
            log.exception("engine loop stopped")
            with self._cond:
                self.error = e
                pending = list(self._callbacks)
            for request_id in pending:
                self._deliver(RequestOutput(request_id, [], "", None, True, "abort", 0, 0, 0, 0.0, None))

    def _apply(self, command):
        if command[0] == "abort":
            self.engine.abort(command[1])
            return
        if command[0] == "reset":
            command[1]()
            return
        _, request_id, prompt_ids, sampling, stream, quiet = command
        try:
            self.engine.add_request(request_id, prompt_ids, sampling, quiet=quiet)
        except RequestError:
            log.exception("request %s refused", request_id)
            self._deliver(RequestOutput(request_id, [], "", None, True, "abort",
                                        len(prompt_ids), 0, 0, 0.0, None))
            return
        if stream:
            self.text.start(request_id, prompt_ids)

    def _deliver(self, *outs: RequestOutput):
        """Hand each output to its request's callback (a step's outputs under one lock)."""
        with self._cond:
            get, pop = self._callbacks.get, self._callbacks.pop
            callbacks = [(pop if out.finished else get)(out.request_id, None) for out in outs]
        for out, callback in zip(outs, callbacks):
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:
                log.exception("on_output callback of %s failed", out.request_id)
