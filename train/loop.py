"""The training loop: steps, evaluation, checkpoints, a progress line and a JSONL metrics log."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import jax

from .data import Batches, Dataset, eval_batches
from .step import Trainer


@dataclasses.dataclass
class LoopSettings:
    steps: int
    batch_size: int
    accum: int = 1
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 20
    log_every: int = 10
    time_budget: float | None = None  # seconds; stop (and checkpoint) once spent
    quiet: bool = False


class Progress:
    """One line: step, bar, loss, tokens/s, ETA. Redrawn in place on a terminal, otherwise
    printed every `log_every` steps."""

    def __init__(self, total: int, start: int, quiet: bool = False):
        self.total, self.start, self.quiet = total, start, quiet
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def line(self, step: int, loss: float, tok_s: float) -> str:
        done = (step - self.start) / max(time.perf_counter() - self.t0, 1e-9)
        eta = (self.total - step) / done if done > 0 else math.inf
        filled = int(20 * step / self.total)
        return (f"step {step}/{self.total} [{'#' * filled}{'.' * (20 - filled)}] loss {loss:.4f}"
                f" | {tok_s / 1e3:.1f}k tok/s | ETA {_duration(eta)}")

    def show(self, step: int, loss: float, tok_s: float):
        if self.quiet:
            return
        text = self.line(step, loss, tok_s)
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)

    def note(self, text: str):
        if not self.quiet:
            print(("\n" if self.tty else "") + text, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def evaluate(trainer: Trainer, params, dataset: Dataset, batch_size: int,
             max_batches: int) -> dict:
    """Mean held-out objective ("eval_loss": the cross-entropy, or with a teacher the distilled
    objective) and perplexity over (up to) max_batches batches; with a teacher also the mean
    cross-entropy, KL and argmax agreement ("eval_ce", "eval_kl", "eval_agree")."""
    sums: dict[str, float] = {}
    for batch in eval_batches(dataset.eval, batch_size, max_batches):
        for k, v in jax.device_get(trainer.eval(params, trainer.put_batch(batch, accum=False))).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    count = max(sums.get("tokens", 0.0), 1.0)
    loss, ce = sums.get("objective", 0.0) / count, sums.get("ce", 0.0) / count
    out = {"eval_loss": loss, "eval_ppl": math.exp(min(ce, 50.0)),
           "eval_tokens": int(sums.get("tokens", 0.0))}
    if "kl" in sums:
        out.update(eval_ce=ce, eval_kl=sums["kl"] / count, eval_agree=sums["agree"] / count)
    return out


class MetricsLog:
    """Keeps step metrics on device and reads them back once per `log_every` steps (reading
    every step would stall the GPU); then shows the progress line and appends a JSONL record
    with the interval's mean loss."""

    def __init__(self, path, progress: Progress, batches: Batches):
        self.file = open(path, "a") if path else None
        self.progress, self.batches = progress, batches
        self.pending, self.t_start = [], time.perf_counter()
        self.t_last = self.t_start

    def add(self, metrics):
        self.pending.append(metrics)

    def flush(self, step: int):
        host, self.pending = jax.device_get(self.pending), []
        now = time.perf_counter()
        tok_s = sum(float(m["tokens"]) for m in host) / max(now - self.t_last, 1e-9)
        self.t_last = now
        loss = sum(float(m["loss"]) for m in host) / len(host)
        self.progress.show(step, loss, tok_s)
        extra = {k: sum(float(m[k]) for m in host) / len(host) for k in ("ce", "kl", "agree")
                 if k in host[-1] and "kl" in host[-1]}
        self.write({"step": step, "loss": loss, **extra, "lr": float(host[-1]["lr"]),
                    "grad_norm": float(host[-1]["grad_norm"]), "tokens_per_s": tok_s,
                    "epoch": self.batches.epoch(step), "elapsed_s": now - self.t_start})

    def write(self, record: dict):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        if self.file:
            self.file.close()


def run_loop(trainer: Trainer, state, dataset: Dataset, settings: LoopSettings, checkpoints=None,
             meta: dict | None = None, metrics_file=None, on_eval=None):
    """Train from state["step"] to settings.steps, or until the time budget is spent; the last
    step is always checkpointed. `on_eval(step, state, result)` sees each evaluation."""
    s = settings
    batches = Batches(dataset.train, s.batch_size, s.accum, s.seed)
    step = int(state["step"])
    progress = Progress(s.steps, step, s.quiet)
    log = MetricsLog(metrics_file, progress, batches)
    while step < s.steps:
        state, metrics = trainer.step(state, trainer.put_batch(batches(step)))
        step += 1
        log.add(metrics)
        stop = s.time_budget is not None and time.perf_counter() - log.t_start > s.time_budget
        last = step == s.steps or stop
        if step % s.log_every == 0 or last:
            log.flush(step)
        if s.eval_every and (step % s.eval_every == 0 or last):
            result = {"step": step, **evaluate(trainer, state["params"], dataset, s.batch_size,
                                               s.eval_batches)}
            progress.note(f"eval at step {step}: loss {result['eval_loss']:.4f}, "
                          f"perplexity {result['eval_ppl']:.2f}" + (
                              f", agreement with the teacher {result['eval_agree']:.3f}"
                              if "eval_agree" in result else ""))
            log.write(result)
            if on_eval:
                on_eval(step, state, result)
        if checkpoints is not None:
            checkpoints.save(step, state, {**(meta or {}), "data_step": step}, force=last)
        if stop:
            progress.note(f"time budget of {s.time_budget:.0f}s spent at step {step}")
            break
    progress.note("")
    if checkpoints is not None:
        checkpoints.wait()
    log.close()
    return state
