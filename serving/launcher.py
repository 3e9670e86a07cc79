"""A step's programs launched on a thread of their own, beside the engine's.

Calling a compiled program spends most of its time in XLA's runtime with the GIL released: on a
GPU, 1-2 ms a step to launch the forward program's CUDA graph, more at a thousand rows
(docs/BENCHMARKS.md, "On an H200"). An engine on a GPU (or made with `launch_thread=True`, or under
$PALLASITE_LAUNCH_THREAD=1) makes that call here, while its own thread reads the previous step back
and accepts its tokens, and while its caller takes the outputs (the engine loop delivers them), so
the launch overlaps both. One worker keeps the launches in order; the next step waits for the
launch before it touches the device state, and raises the launch's error if it failed.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import Future, ThreadPoolExecutor


class Launcher:
    def __init__(self):
        self._pool = None  # made at the first launch: an engine that never steps keeps no thread

    def submit(self, fn, *args) -> Future:
        """Run fn(*args) on the launch thread, in the caller's context (the context variables
        that a compilation on a cache miss reads, such as the batch-invariant setting)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pallasite-launch")
        return self._pool.submit(contextvars.copy_context().run, fn, *args)
