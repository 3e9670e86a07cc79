"""The engine loop's delivery of a step's outputs to `LLM.generate`'s callbacks (CPU only).

After each step the loop thread hands every running request its output (engine_loop.py), and
`LLM.generate`'s callback folds it into the request's result (llm.py, `gather`). At a thousand
running requests that is a thousand calls a step on the loop's thread, before it can step
again. This times that delivery for `--seqs` outputs a step, medians of `--reps` rounds.

    python -m benchmarks.deliver --seqs 1024
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from functools import partial

import numpy as np

from pallasite.serving.engine import RequestOutput
from pallasite.serving.engine_loop import EngineLoop
from pallasite.serving.llm import Completion, SamplingParams, gather


def deliver_ms(seqs: int, steps: int = 50) -> float:
    """Milliseconds a step to deliver `seqs` outputs of one token each."""
    loop = EngineLoop.__new__(EngineLoop)  # its delivery alone: no engine, no thread
    loop._cond, ids = threading.Condition(), [[1, 2, 3]] * seqs
    results = [Completion("", [], None, 3, 0, 0) for _ in ids]
    on_output = gather(results, ids, [SamplingParams()] * seqs, None, lambda: None)
    loop._callbacks = {f"g{i}": partial(on_output, i) for i in range(seqs)}
    outs = [RequestOutput(f"g{i}", [5], None, None, False, None, 3, 0, 1, 0.0, 0.0)
            for i in range(seqs)]
    t = time.perf_counter()
    for _ in range(steps):
        loop._deliver(*outs)
    assert all(len(r.token_ids) == steps for r in results)
    return 1e3 * (time.perf_counter() - t) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    times = [deliver_ms(args.seqs) for _ in range(args.reps)]
    rec = dict(mode="deliver", seqs=args.seqs, ms_per_step=float(np.median(times)),
               rounds=times)
    print(f"delivery of {args.seqs} outputs a step: {rec['ms_per_step']:.3f} ms (median of "
          f"{args.reps})")
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
