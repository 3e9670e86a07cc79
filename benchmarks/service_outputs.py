"""Host cost of a server's outputs (CPU only): requests through the engine loop and the
service's `Request` (an asyncio queue each, as the gRPC and HTTP servers take them), streamed
(an output a token) or unary (two outputs: the engine's `quiet` request), on `host_step`'s
stand-in engine, whose programs return at once: what is timed is the host's own work.

    python -m benchmarks.service_outputs --requests 512 --tokens 64 --out DIR

Prints, for each form, the outputs handed over, the wall seconds from submission until every
request has finished, and the process's CPU ms per 1000 tokens (engine thread and event loop
together); writes DIR/service_outputs.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

from benchmarks.common import run_info
from benchmarks.host_step import python_loop_ms, stand_in_engine


async def _serve(engine_loop, prompts, sampling, stream: bool) -> int:
    """Submit every prompt at once and read each request's outputs until it ends."""
    from pallasite.serving.service import Request
    reqs = [Request(engine_loop, f"r{i}", p, sampling, stream) for i, p in enumerate(prompts)]

    async def drain(req):
        n = 0
        while not req.finished:
            n += len(await req.next())
        return n
    return sum(await asyncio.gather(*map(drain, reqs)))


def run(requests: int, tokens: int, stream: bool, seed: int = 0) -> dict:
    from pallasite.serving.engine_loop import EngineLoop
    from pallasite.serving.llm import SamplingParams
    engine = stand_in_engine(num_pages=requests * 8 + 256, max_num_seqs=requests,
                             max_num_batched_tokens=max(8192, requests))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 4000, 32).tolist() for _ in range(requests)]
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    loop = EngineLoop(engine)
    try:
        asyncio.run(_serve(loop, prompts[:8], sampling, stream))  # the stand-ins, once
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = asyncio.run(_serve(loop, prompts, sampling, stream))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        loop.close()
    return dict(form="stream" if stream else "unary", requests=requests, tokens=tokens,
                outputs=outputs, wall_s=wall, cpu_ms_per_1k_tokens=1e6 * cpu / (requests * tokens))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each form, alternating")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    info = dict(run_info(device=False), python_loop_ms=python_loop_ms())
    print(json.dumps(info), flush=True)
    records = []
    for _ in range(args.repeats):
        for stream in (True, False):
            rec = run(args.requests, args.tokens, stream)
            records.append(rec)
            print(f"{rec['form']:>6}: {rec['outputs']} outputs, {rec['wall_s']:.2f} s, "
                  f"{rec['cpu_ms_per_1k_tokens']:.1f} CPU ms per 1000 tokens", flush=True)
    for form in ("stream", "unary"):
        cpu = [r["cpu_ms_per_1k_tokens"] for r in records if r["form"] == form]
        wall = [r["wall_s"] for r in records if r["form"] == form]
        print(f"{form}: median {np.median(wall):.2f} s, {np.median(cpu):.1f} CPU ms per 1000 "
              "tokens", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "service_outputs.json"), "w") as f:
        json.dump(dict(info, records=records), f, indent=1)


if __name__ == "__main__":
    main()
