"""Warm-up: compile every program a step can need ahead of time, so that no request waits for a
compilation, with as many workers as the cores and the free memory take, and show how far it has
got.

The programs (`plan`): one forward pass per reachable (token bucket T, page bucket P) pair; one
sampler per sequence-axis size S = min(T, max_num_seqs) x rows per sequence (1 + speculative
tokens) x variant (`sampling.MODES`: greedy, sample, filter) x (free, guided: the structured
output mask and logit bias); the penalties' history loader; a draft model's own programs.
The variants are separate programs rather than one program with a `lax.cond`: XLA:GPU reads a
conditional's predicate back to the host, which stops the host from running a step ahead
(docs/BENCHMARKS.md: batch-1 decode 12.3 ms with the cond, 5.9 ms without).

The persistent compilation cache (`settings.enable_compilation_cache`) is on by default: a
second start loads these programs instead of compiling them; the report says how many it found.

The last thing warm-up does is set the garbage collector for serving (`settle_heap`): it
collects what warm-up left, then lets more objects be made before a young collection. A step at
1024 sequences holds a few thousand objects (its outputs) until the caller drops them; at
Python's default (700) several young collections a step walk them and push them towards the old
generation, whose full collections (which walk every object of the process: modules, compiled
programs, a couple of hundred thousand objects, on the order of 100 ms) they then bring on every
few hundred steps. The heap is not frozen (`gc.freeze`): an engine dropped later could then never
be collected, nor the device memory it holds.

A compilation's memory grows with the program (a 30-layer model's step, unrolled, takes about a
gigabyte on XLA:CPU), so running one per thread on a small machine can exhaust it. Where memory
is short the largest program is compiled first, alone, and the memory it took bounds how many of
the rest run at once; where it is plentiful (a GPU host) all start at once.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

MEMORY_FRACTION = 0.5  # of the memory available at warm-up that compilations may take at once
PLENTY = 64 << 30  # available bytes above which no compilation is measured alone first
YOUNG_GC_THRESHOLD = 50_000  # new container objects (net) between young collections


def default_page_buckets(max_pages: int, gpu: bool | None = None) -> list[int]:
    """Page-table widths to compile. On GPU two: a step's attention kernels read what the table
    spans. Elsewhere one: the jnp attention there (`kernels/ragged_jnp.py`) stops at the longest
    context in the step whatever the table's width, so a second width would only double the
    warm-up's compilations."""
    import jax
    if gpu if gpu is not None else jax.default_backend() == "gpu":
        return [max(1, max_pages // 8), max_pages]
    return [max_pages]


# -- what warm-up compiles ----------------------------------------------------------------------
def step_keys(token_buckets, page_buckets, max_num_seqs: int, page_size: int) -> list:
    """The (T, P) pairs a step can take, largest first. A step lands in T only with more tokens
    than the bucket below, and each of its at most min(T, max_num_seqs) sequences schedules no
    more tokens than its context, at most P pages: a pair where those cannot fit never occurs."""
    keys = []
    for i, T in enumerate(token_buckets):
        need = (token_buckets[i - 1] if i else 0) + 1
        keys += [(T, P) for P in page_buckets if need <= min(T, max_num_seqs) * P * page_size]
    return sorted(keys, key=lambda k: -k[0] * k[1])


def sampler_keys(steps, max_num_seqs: int, rows: int = 1) -> list:
    """(S, mode) and (S, mode, "guided") for every sequence-axis size the steps produce."""
    from .sampling import MODES
    sizes = sorted({min(T, max_num_seqs) * rows for T, _ in steps}, reverse=True)
    return [(S, m, *g) for S in sizes for m in MODES for g in ((), ("guided",))]


WHY = dict(greedy="argmax only", sample="temperature, penalties, seeds, logprobs",
           filter="+ the sort behind top-k / top-p / min-p")


def plan(token_buckets, page_buckets, max_num_seqs: int, page_size: int, rows: int = 1,
         history: bool = True) -> list[tuple[str, str]]:
    """Every program warm-up compiles, named, with why it exists."""
    steps = step_keys(token_buckets, page_buckets, max_num_seqs, page_size)
    out = [(f"step T={T} P={P}", f"forward over a {T}-token step, page tables {P} pages wide")
           for T, P in steps]
    for S, mode, *g in sampler_keys(steps, max_num_seqs, rows):
        why = f"sample {S // rows} sequences" + (f" x {rows} rows (speculative verify)"
                                                  if rows > 1 else "") + f": {WHY[mode]}"
        out.append((" ".join(["sampler", f"S={S}", mode, *g]),
                    why + (", structured-output mask and logit bias" if g else "")))
    if history:
        out.append(("history loader", "penalties: a sequence's tokens into its history row"))
    return out


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


def compile_all(jobs: list, names: list[str], workers: int | None = None,
                progress: Progress | None = None) -> list:
    """Run each job (lower and compile one program: tracing holds the GIL, compiling does not,
    so the workers' tracing overlaps the others' compiling) -> [(executable, seconds)]. Where
    memory is short, the first job (the largest) runs alone to measure what one takes."""
    if not jobs:
        return []
    progress = progress or Progress(len(jobs))
    try:
        available, head = available_memory(), []
        if not workers and (available is None or available < PLENTY):
            head, per_job = measured(lambda: [timed(jobs[0])])
            progress.step(names[0])
            workers = workers_for(len(jobs) - 1, per_job, usable_cores(), available)
        workers = workers or workers_for(len(jobs), None, usable_cores(), available)

        def one(item):
            job, name = item
            out = timed(job)
            progress.step(name)
            return out

        with ThreadPoolExecutor(workers) as pool:
            rest = list(pool.map(one, zip(jobs[len(head):], names[len(head):])))
    finally:
        progress.close()
    return head + rest


def timed(job):
    t = time.perf_counter()
    return job(), time.perf_counter() - t


class CompileCounter:
    """Counts, while open, the executables JAX builds (compiled, or loaded from the persistent
    cache) and the persistent cache's hits."""
    COMPILE, HIT = "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.compiles = self.hits = 0

    def _duration(self, event, *args, **kw):
        self.compiles += event == self.COMPILE

    def _event(self, event, *args, **kw):
        self.hits += event == self.HIT

    def __enter__(self):
        import jax
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        import jax
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


def warm_up(engine, workers: int | None = None):
    """Compile every program in `plan` that the engine lacks (in parallel threads, as many as
    the cores and memory take) and the history loader, then (on GPU, where a first run loads
    modules) run each once on an all-padding batch, which writes no page and no slot. Leaves a
    summary in `engine.warmup_report`."""
    import jax
    from .settings import compiler_options, enable_compilation_cache
    t0, cache_dir, before = time.perf_counter(), enable_compilation_cache(), engine.compilations
    steps = step_keys(engine.token_buckets, engine.page_buckets, engine.max_num_seqs,
                      engine.page_size)
    keys = [k for k in steps if k not in engine._exe]
    samplers = [k for k in sampler_keys(steps, engine.max_num_seqs, engine.rows)
                if k not in engine._samplers]
    names = [f"step T={T} P={P}" for T, P in keys] + [
        " ".join(["sampler", f"S={k[0]}", *k[1:]]) for k in samplers]
    with CompileCounter() as counter:
        tracing = []  # seconds each job spent tracing and lowering (under the GIL)

        def build(lower, *key, tokens=None):
            t = time.perf_counter()
            lo = lower(*key)
            tracing.append(time.perf_counter() - t)
            return lo.compile(compiler_options(tokens))

        jobs = [partial(build, engine._lower, k, tokens=k[0]) for k in keys] + [
            partial(build, engine._lower_sampler, *k) for k in samplers]
        compiled = compile_all(jobs, names, workers)
        engine._exe.update(zip(keys, (c for c, _ in compiled[:len(keys)])))
        engine._samplers.update(zip(samplers, (c for c, _ in compiled[len(keys):])))
        engine.compilations += len(jobs)
        if engine._load is None:
            engine._compile_load()
        engine.make_logits({min(T, engine.max_num_seqs) * engine.rows for T, _ in steps})
        t_compile = time.perf_counter() - t0
        if first_run_loads():
            run_once(engine, keys, samplers)
        if engine.spec:
            engine.compilations += engine.spec.warmup()
        jax.block_until_ready(engine.state)
    slowest = sorted(zip(names, (s for _, s in compiled)), key=lambda x: -x[1])
    engine.warmup_report = dict(
        seconds=time.perf_counter() - t0, compile_s=t_compile, lowering_s=sum(tracing),
        programs=engine.compilations - before, jax_compiles=counter.compiles,
        cache_hits=counter.hits, cache_dir=cache_dir,
        steps=len(keys), samplers=len(samplers), slowest=[(n, round(s, 2)) for n, s in slowest[:8]])
    settle_heap()
    if len(jobs) > 1:
        print(f"pallasite: warm-up built {engine.compilations - before} programs in "
              f"{engine.warmup_report['seconds']:.1f} s ({counter.hits} from the compilation "
              f"cache{' ' + cache_dir if cache_dir else ', off'})", file=sys.stderr, flush=True)
    return engine


def settle_heap(young: int = YOUNG_GC_THRESHOLD):
    """Collect what is garbage now, and raise (never lower) the count of new objects that
    brings a young collection to `young`."""
    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], young), *threshold[1:])


def run_once(engine, keys, samplers):
    """Run each new program once on padding (no page or slot written): on GPU a first run
    loads its kernels' modules."""
    import jax.numpy as jnp
    import numpy as np
    from . import sampling
    from .batch import int_layout
    from .structured import guided_layout
    for T, P in keys:
        S = min(T, engine.max_num_seqs)
        fill = dict(kv_slots=-1, sources=-1)  # padding: no write
        ints = np.concatenate([np.full(n, fill.get(name, 0), np.int32)
                               for name, n in int_layout(T, S, P, engine.rows).items()])
        kv, last_tokens, history = engine.state
        _, kv = engine._forward(engine._exe[(T, P)], kv, last_tokens, ints, S * engine.rows)
        engine.state = (kv, last_tokens, history)
    for S, mode, *guided in samplers:
        floats, rows = sampling.pack_rows([], S)
        ints = np.concatenate([np.full(S, -1, np.int32), rows.ravel()])  # -1: no sample
        extra = guided_layout(S, engine.config.vocab_size) if guided else (0, 0)
        ints = np.concatenate([ints, np.full(extra[0], -1, np.int32)])
        floats = np.concatenate([floats.ravel(), np.zeros(extra[1], np.float32)])
        kv, last_tokens, history = engine.state
        logits = jnp.zeros((S, engine.config.vocab_size), jnp.float32, device=engine._inputs)
        _, last_tokens, history = engine._samplers[(S, mode, *guided)](
            logits, last_tokens, history, ints, floats)
        engine.state = (kv, last_tokens, history)
