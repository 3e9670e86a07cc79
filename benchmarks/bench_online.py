"""Online load generator: streams requests to a running `pallasite serve` and measures what its
users see.

    python -m benchmarks.bench_online --server 127.0.0.1:50051 --rate 1,2,4,8 --num-requests 200
    python -m benchmarks.bench_online --server HOST:PORT --concurrency 32 --prompts prompts.jsonl
    python -m benchmarks.bench_online --server HOST:50051 --http HOST:8000 --rate 4  (gRPC vs HTTP)
    python -m benchmarks.bench_serving --online ...        (the same)

Arrivals are Poisson at each `--rate` (requests/s; `inf` sends them all at once), or come from
`--concurrency` clients that each send their next request when the previous one ends. Each run
stops sending after `--num-requests` or `--duration` seconds, whichever comes first, and ends at
most `--max-wait` seconds after that, cancelling the calls still under way (counted as errors). Prompts are random
token ids of `--input-len` tokens with `--output-len` tokens generated (EOS ignored, so lengths
are exact), or lines of a JSONL file: {"prompt": text} or {"token_ids": [...]} or
{"messages": [...]}, with an optional "max_tokens".

Per run: TTFT, TPOT (time per output token after the first), ITL (time between tokens) and
end-to-end latency at p50/p90/p99 and mean, request and token throughput, and goodput: the
completed requests per second whose TTFT and TPOT both meet the SLA (`--slo-ttft-ms`,
`--slo-tpot-ms`). Prints a table; `--out FILE` writes the records as JSON.

`--http HOST:PORT` (the same server's `--http-port`) runs each load a second time through the
OpenAI HTTP API (SSE streams, `return_token_ids` for token counts): the same arrivals and
lengths, random token prompts shifted by one id so that they miss the prefix cache. Its record
has `api: "http"` and `ratio_vs_grpc`, its output token throughput over the gRPC run's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time

import numpy as np


@dataclasses.dataclass
class Result:
    """One request as the client saw it; times in seconds from its send."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None  # the status code name of a failed call

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# -- workload --------------------------------------------------------------------------------
def span(text: str) -> tuple[int, int]:
    """'128' or '128:2048' (inclusive)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def random_prompts(n: int, vocab_size: int, input_len, output_len, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(input_len[0], input_len[1] + 1))
        out.append(dict(token_ids=rng.integers(0, vocab_size, length).tolist(),
                        max_tokens=int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


def file_prompts(path: str, n: int, output_len, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    rng = random.Random(seed)
    picked = [rows[i % len(rows)] for i in range(n)]
    for row in picked:
        row.setdefault("max_tokens", rng.randint(*output_len))
    return picked


def prompt_of(row: dict):
    for key in ("token_ids", "messages", "prompt"):
        if key in row:
            return row[key]
    raise SystemExit(f"a prompt line needs 'prompt', 'token_ids' or 'messages': {row}")


# -- one request -----------------------------------------------------------------------------
async def send(client, row: dict, sampling: dict) -> Result:
    import grpc
    res, last = Result(), None
    t0 = time.perf_counter()
    try:
        async for chunk in client.stream(prompt_of(row), max_tokens=row["max_tokens"], **sampling):
            now, n = time.perf_counter() - t0, len(chunk.token_ids)
            if n and res.ttft is None:
                res.ttft = now
            elif n:
                res.itl += [(now - last) / n] * n  # tokens that came together share the gap
            if n:
                last = now
                res.output_tokens += n
            if chunk.finish_reason:
                res.prompt_tokens = chunk.usage.prompt_tokens
        res.e2e = time.perf_counter() - t0
    except grpc.RpcError as e:
        res.error = e.code().name
    except OSError as e:  # the HTTP client's errors (HttpStatusError is one)
        res.error = f"HTTP {getattr(e, 'status', type(e).__name__)}"
    except asyncio.CancelledError:  # the run's time is up: counted as an error, not raised
        res.error = "CANCELLED"
    return res


# -- one run ---------------------------------------------------------------------------------
async def run_rate(client, rows, sampling, rate: float, duration: float, rng) -> list:
    """Poisson arrivals at `rate` per second (inf: all at once); returns the tasks."""
    tasks, start = [], time.perf_counter()
    for row in rows:
        if tasks and math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1 / rate))
        if time.perf_counter() - start > duration:
            break
        tasks.append(asyncio.create_task(send(client, row, sampling)))
    return tasks


def run_concurrency(client, rows, sampling, n: int, duration: float):
    """`n` clients, each sending its next request when its last one ends; returns the worker
    tasks and the list their results go to."""
    todo, start, results = iter(rows), time.perf_counter(), []

    async def worker():
        for row in todo:  # one shared iterator: each row goes to one worker
            if time.perf_counter() - start > duration:
                return
            results.append(await send(client, row, sampling))

    return [asyncio.create_task(worker()) for _ in range(n)], results


async def bench_one(client, rows, sampling, args, rate=None, concurrency=None) -> dict:
    start = time.perf_counter()
    if rate is not None:
        tasks = await run_rate(client, rows, sampling, rate, args.duration,
                               np.random.default_rng(args.seed))
    else:
        tasks, results = run_concurrency(client, rows, sampling, concurrency, args.duration)
    left = start + args.duration + args.max_wait - time.perf_counter()
    _, pending = await asyncio.wait(tasks, timeout=max(left, 0.0))
    for t in pending:  # out of time: their requests count as CANCELLED
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    if rate is not None:
        results = [t.result() for t in tasks]
        rate = rate if math.isfinite(rate) else "inf"
    return summarize(results, wall, args) | dict(rate=rate, concurrency=concurrency)


# -- numbers -----------------------------------------------------------------------------------
def percentiles(name: str, values, scale=1e3) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {f"{name}_{k}": None for k in ("mean", "p50", "p90", "p99")}
    a = np.asarray(values) * scale
    return {f"{name}_mean": float(a.mean()), **{f"{name}_p{q}": float(np.percentile(a, q))
                                                  for q in (50, 90, 99)}}


def summarize(results: list[Result], wall: float, args) -> dict:
    ok = [r for r in results if r.error is None]
    errors = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    good = [r for r in ok if r.ttft is not None and r.ttft * 1e3 <= args.slo_ttft_ms
            and (r.tpot is None or r.tpot * 1e3 <= args.slo_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    return dict(
        mode="online", requests=len(results), completed=len(ok), errors=errors, wall_s=wall,
        request_per_s=len(ok) / wall, output_tok_per_s=out_tokens / wall,
        total_tok_per_s=(out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
        goodput_req_per_s=len(good) / wall, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, mean_output_tokens=out_tokens / max(len(ok), 1),
        **percentiles("ttft_ms", [r.ttft for r in ok]),
        **percentiles("tpot_ms", [r.tpot for r in ok]),
        **percentiles("itl_ms", [x for r in ok for x in r.itl]),
        **percentiles("e2e_ms", [r.e2e for r in ok]))


def table(records) -> str:
    head = ("| load | done | req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
            "| ITL p50/p99 ms | goodput req/s |")
    rows = [head, "|" + "---|" * 8]

    def ms(r, name):
        a, b = r[f"{name}_p50"], r[f"{name}_p99"]
        return "-" if a is None else f"{a:.1f} / {b:.1f}"
    for r in records:
        load = f"rate {r['rate']}" if r["rate"] is not None else f"conc {r['concurrency']}"
        if r.get("api") == "http":
            load += f" http ({r['ratio_vs_grpc']:.2f}x gRPC)"
        rows.append(f"| {load} | {r['completed']}/{r['requests']} | {r['request_per_s']:.2f} | "
                    f"{r['output_tok_per_s']:.0f} | {ms(r, 'ttft_ms')} | {ms(r, 'tpot_ms')} | "
                    f"{ms(r, 'itl_ms')} | {r['goodput_req_per_s']:.2f} |")
    return "\n".join(rows)


# -- main --------------------------------------------------------------------------------------
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of pallasite serve")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", default=None,
                      help="Poisson arrival rates, requests/s, comma-separated (inf: all at once)")
    load.add_argument("--concurrency", default=None, help="client counts, comma-separated")
    ap.add_argument("--num-requests", type=int, default=100, help="most requests per run")
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds per run in which requests are sent")
    ap.add_argument("--max-wait", type=float, default=60.0,
                    help="seconds the calls under way get after that, then they are cancelled")
    ap.add_argument("--prompts", default=None, help="JSONL file of prompts (default: random ids)")
    ap.add_argument("--input-len", type=span, default=(128, 512), help="N or LO:HI tokens")
    ap.add_argument("--output-len", type=span, default=(64, 256), help="N or LO:HI tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-ready", type=float, default=600.0,
                    help="seconds to wait for the server's health to report SERVING")
    ap.add_argument("--http", default=None, metavar="HOST:PORT",
                    help="also run each load through the OpenAI HTTP API of the same server")
    ap.add_argument("--out", default=None, help="write the records to this JSON file")
    return ap.parse_args(argv)


async def bench(args) -> list[dict]:
    from pallasite.serving.client import AsyncClient, Client
    from .common import run_info
    with Client(args.server) as c:
        info = c.wait_ready(args.wait_ready).model_info()
    loads = [("rate", float(x)) for x in args.rate.split(",")] if args.rate else \
        [("concurrency", int(x)) for x in (args.concurrency or "8").split(",")]
    n = args.num_requests

    def workload(seed):  # fresh random prompts per run, so no run hits an earlier one's cache
        if args.prompts:
            return file_prompts(args.prompts, n, args.output_len, seed)
        return random_prompts(n, info.vocab_size, args.input_len, args.output_len, seed)
    sampling = dict(temperature=args.temperature, ignore_eos=True)
    env = dict(server=args.server, model=info.model_name, dtype=info.dtype, mesh=info.mesh,
               max_num_seqs=info.max_num_seqs, kv_pages=info.kv_pages,
               input_len=list(args.input_len), output_len=list(args.output_len),
               prompts=args.prompts or "random",
               **run_info(device=False))
    records = []
    http = None
    if args.http:
        from .openai_stream import HttpStreamClient
        http = HttpStreamClient(args.http).wait_ready(args.wait_ready)
    async with AsyncClient(args.server) as client:
        for c in (client, http) if http else (client,):
            async for _ in c.stream(prompt_of(workload(args.seed + len(loads))[0]), max_tokens=2,
                                    **sampling):
                pass  # one request first: connection up, nothing cold in the measured runs
        for i, (kind, value) in enumerate(loads):
            rows = workload(args.seed + i)
            rec = await bench_one(client, rows, sampling, args, **{kind: value})
            records.append(rec | env | dict(api="grpc"))
            print(json.dumps(rec), flush=True)
            if http:  # the same load; token prompts shifted by one id (no prefix-cache hits)
                rows = [dict(r, token_ids=[(t + 1) % info.vocab_size for t in r["token_ids"]])
                        if "token_ids" in r else r for r in rows]
                rec_http = await bench_one(http, rows, sampling, args, **{kind: value})
                rec_http["ratio_vs_grpc"] = rec_http["output_tok_per_s"] / max(
                    rec["output_tok_per_s"], 1e-9)
                records.append(rec_http | env | dict(api="http", http=args.http))
                print(json.dumps(rec_http), flush=True)
    return records


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else list(argv))
    records = asyncio.run(bench(args))
    print(table(records))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
