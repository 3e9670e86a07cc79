"""Warm-up sized to the machine: compile the step's shapes ahead of time with as many workers as
the cores and the free memory take, and show how far it has got.

A compilation's memory grows with the program (a 30-layer model's step, unrolled, takes about a
gigabyte on XLA:CPU), so running one per thread on a small machine can exhaust it. The largest
program is compiled first, alone; the memory it took bounds how many of the rest run at once.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

MEMORY_FRACTION = 0.5  # of the memory available at warm-up that compilations may take at once


def default_page_buckets(max_pages: int) -> list[int]:
    """Page-table widths to compile. On GPU two: a step's attention kernels read what the table
    spans. Elsewhere one: the jnp attention there (`kernels/ragged_jnp.py`) stops at the longest
    context in the step whatever the table's width, so a second width would only double the
    warm-up's compilations."""
    import jax
    if jax.default_backend() == "gpu":
        return [max(1, max_pages // 8), max_pages]
    return [max_pages]


def first_run_loads() -> bool:
    """Whether an executable's first run does one-time work worth doing at warm-up: on GPU it
    loads its kernels' modules. On CPU there is nothing to load, and a run of the 512-token step
    on padding costs as much as a real one."""
    import jax
    return jax.default_backend() != "cpu"


def available_memory() -> int | None:
    """Bytes the kernel reports available (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss() -> int:
    """This process's resident memory in bytes now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measured(fn):
    """fn() and the most memory it added while it ran (sampled every 20 ms)."""
    before, top, running = rss(), [0], [True]

    def sample():
        while running[0]:
            top[0] = max(top[0], rss())
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        out = fn()
    finally:
        running[0] = False
        watcher.join()
    return out, max(top[0], rss()) - before


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


MAX_WORKERS = 8  # compilations on a GPU also autotune on it: more at once only contend


def workers_for(jobs: int, per_job: int | None, cores: int, available: int | None) -> int:
    """Parallel compilations: no more than the cores, the jobs, MAX_WORKERS, nor what the
    memory holds."""
    n = max(1, min(cores, jobs, MAX_WORKERS))
    if per_job and per_job > 0 and available:
        n = min(n, max(1, int(MEMORY_FRACTION * available // per_job)))
    return n


class Progress:
    """Which compilation, how many left, elapsed: a bar on a terminal, else a line per step."""

    def __init__(self, total: int, label: str = "warm-up", stream=None):
        self.total, self.done, self.label, self.t0 = total, 0, label, time.perf_counter()
        self.stream = stream or sys.stderr
        self.bar = None
        if total > 1 and getattr(self.stream, "isatty", lambda: False)():
            from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn
            self.bar = Bar(TextColumn("{task.description}"), BarColumn(),
                           TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                           transient=True)
            self.task = self.bar.add_task(label, total=total)
            self.bar.start()

    def step(self, what: str):
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{self.label}: {what}")
        elif self.total > 1:
            print(f"pallasite: {self.label} {self.done}/{self.total} ({what}), "
                  f"{self.total - self.done} left, {elapsed:.0f} s", file=self.stream, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def compile_all(lowered: list, names: list[str], workers: int | None = None,
                progress: Progress | None = None) -> list:
    """Compile each lowered program; the first (the largest) alone, to measure what one takes."""
    if not lowered:
        return []
    progress = progress or Progress(len(lowered))
    try:
        first, per_job = measured(lowered[0].compile)
        progress.step(names[0])
        n = workers or workers_for(len(lowered) - 1, per_job, usable_cores(), available_memory())

        def one(item):
            lo, name = item
            out = lo.compile()
            progress.step(name)
            return out

        with ThreadPoolExecutor(n) as pool:
            rest = list(pool.map(one, zip(lowered[1:], names[1:])))
    finally:
        progress.close()
    return [first] + rest
