"""`python -m pallasite.tools.soak`: a loopback soak and overload test of `pallasite serve`.

It starts the server (or uses `--server HOST:PORT`), then for `--minutes` runs waves of mixed
streaming requests: plain ones, prefix-sharing ones, long prompts, ones cancelled mid-stream,
ones with a deadline too short to finish, and bad inputs. After each wave it waits for the
server to go quiet and reads, from its /metrics, the KV pages still held by sequences: they must
fall back to zero (pages kept only by the prefix cache are counted apart). Each wave ends with an
overload burst past the admission queue bound: some calls must get RESOURCE_EXHAUSTED quickly,
and a plain request right after must succeed. It records the server's RSS over time, status codes
and p50/p99 latencies, and writes a JSON record.

    python -m pallasite.tools.soak --minutes 10 --out docs/benchmarks/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request

import grpc

EXPECTED = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
WORDS = ("the list of functions returns a value for each item in the sequence when the "
         "argument is given as a keyword and the object is not None").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class Soak:
    def __init__(self, target: str, metrics_url: str, pid: int | None, queue: int, seed: int):
        self.target, self.metrics_url, self.pid, self.queue = target, metrics_url, pid, queue
        self.rng = random.Random(seed)
        self.codes: dict[str, int] = {}
        self.latency: list[float] = []
        self.samples: list[dict] = []  # RSS and pages after each wave
        self.overloads: list[dict] = []
        self.t0 = time.time()

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _count(self, code: str):
        self.codes[code] = self.codes.get(code, 0) + 1

    async def one(self, client, kind: str):
        from pallasite.serving.client import make_request
        rng, prefix = self.rng, "Return the value of the attribute named by the string. "
        kw = dict(max_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8]))
        prompt, timeout, cancel_after = self.text(rng.randint(3, 30)), 60.0, None
        if kind == "prefix":
            prompt = prefix * 8 + self.text(4)
        elif kind == "long":
            prompt = self.text(rng.randint(200, 400))
        elif kind == "cancel":
            cancel_after, kw["max_tokens"] = rng.randint(1, 3), 64
        elif kind == "deadline":
            timeout, kw["max_tokens"] = 0.05, 64
        elif kind == "bad":
            kw = rng.choice([dict(temperature=-1.0), dict(top_p=2.0), dict(max_tokens=10**9),
                             dict(stop_token_ids=[10**9])])
        t = time.perf_counter()
        call = client.stub.Generate(make_request(prompt, **kw), timeout=timeout)
        try:
            n = 0
            async for _ in call:
                n += 1
                if cancel_after is not None and n >= cancel_after:
                    call.cancel()
            self._count("OK")
            self.latency.append(time.perf_counter() - t)
        except grpc.aio.AioRpcError as e:
            self._count(e.code().name)
        except asyncio.CancelledError:
            self._count("CANCELLED")

    async def wave(self, client, n: int):
        kinds = ["plain"] * 4 + ["prefix"] * 2 + ["long", "cancel", "deadline", "bad"]
        await asyncio.gather(*(self.one(client, self.rng.choice(kinds)) for _ in range(n)))

    async def overload(self, client):
        """Past the queue bound: RESOURCE_EXHAUSTED promptly, then service resumes."""
        from pallasite.serving.client import make_request
        t, refused = time.perf_counter(), []

        async def call():
            start = time.perf_counter()
            try:
                await client.stub.GenerateUnary(make_request(self.text(8), max_tokens=8), timeout=120)
                self._count("OK")
            except grpc.aio.AioRpcError as e:
                self._count(e.code().name)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.append(time.perf_counter() - start)

        await asyncio.gather(*(call() for _ in range(self.queue * 2 + 8)))
        after = await client.generate(self.text(5), max_tokens=4)  # raises if not served
        self.overloads.append(dict(refused=len(refused), refuse_s_max=max(refused, default=None),
                                   burst_s=time.perf_counter() - t, resumed=bool(after.token_ids)))

    async def quiet_sample(self, wave: int):
        await asyncio.sleep(0.5)
        for _ in range(100):  # the engine frees pages a step after the last output
            used = metric(self.metrics_url, "pallasite_kv_pages_used")
            if used == 0:
                break
            await asyncio.sleep(0.1)
        self.samples.append(dict(wave=wave, t=round(time.time() - self.t0, 1), pages_used=used,
                                 pages_cached=metric(self.metrics_url, "pallasite_kv_pages_cached"),
                                 rss=rss_bytes(self.pid) if self.pid else None))

    async def run(self, seconds: float, per_wave: int):
        from pallasite.serving.client import AsyncClient
        async with AsyncClient(self.target) as client:
            await self.quiet_sample(0)
            wave = 0
            while time.time() - self.t0 < seconds or wave == 0:
                wave += 1
                await self.wave(client, per_wave)
                await self.overload(client)
                await self.quiet_sample(wave)
        return self.record()

    def record(self) -> dict:
        rss = [s["rss"] for s in self.samples if s["rss"]]
        warm = rss[1] if len(rss) > 1 else None  # after the first wave: compiled, pools made
        return dict(
            seconds=round(time.time() - self.t0, 1), waves=len(self.samples) - 1,
            codes=self.codes, unexpected={c: n for c, n in self.codes.items() if c not in EXPECTED},
            latency_p50_s=percentile(self.latency, 0.5), latency_p99_s=percentile(self.latency, 0.99),
            leaked_pages=max(s["pages_used"] for s in self.samples),
            rss_after_warmup=warm, rss_end=rss[-1] if rss else None,
            rss_growth=(rss[-1] / warm - 1) if warm else None,
            overloads=self.overloads, samples=self.samples)


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    port, mport = free_port(), free_port()
    cmd = [sys.executable, "-m", "pallasite.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--metrics-port", str(mport), "--max-queue", str(args.max_queue)]
    cmd += ["--model", args.model] if args.model else []
    cmd += args.serve_args
    env = {**os.environ, "PALLASITE_CACHE_DIR": os.environ.get("PALLASITE_CACHE_DIR", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"


def check(rec: dict, max_growth: float) -> list[str]:
    """What the soak requires; an empty list when it passed."""
    bad = []
    if rec["unexpected"]:
        bad.append(f"unexpected status codes {rec['unexpected']}")
    if rec["leaked_pages"]:
        bad.append(f"{rec['leaked_pages']:.0f} KV pages still held after a quiet period")
    if rec["rss_growth"] is not None and rec["rss_growth"] > max_growth:
        bad.append(f"RSS grew {100 * rec['rss_growth']:.1f}% after warm-up (limit "
                   f"{100 * max_growth:.0f}%)")
    if not all(o["refused"] and o["resumed"] for o in rec["overloads"]):
        bad.append("an overload burst was not refused, or service did not resume after it")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pallasite.tools.soak", description=__doc__.split("\n")[0])
    p.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--metrics", help="its /metrics URL (with --server)")
    p.add_argument("--model", help="checkpoint for the started server (default: the embedded one)")
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--per-wave", type=int, default=24, help="requests in each wave")
    p.add_argument("--max-queue", type=int, default=8, help="the started server's queue bound")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("serve_args", nargs="*", help="more `pallasite serve` flags (after --)")
    args = p.parse_args(argv)
    proc = None
    if args.server:
        target, metrics_url, pid = args.server, args.metrics, None
    else:
        proc, target, metrics_url = start_server(args)
        pid = proc.pid
    try:
        from pallasite.serving.client import Client
        with Client(target) as client:
            client.wait_ready(600)
        soak = Soak(target, metrics_url, pid, args.max_queue, args.seed)
        rec = asyncio.run(soak.run(60 * args.minutes, args.per_wave))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    rec.update(minutes=args.minutes, max_queue=args.max_queue, model=args.model or "default",
               date=time.strftime("%Y-%m-%d"), command="python -m pallasite.tools.soak " +
               " ".join(argv if argv is not None else sys.argv[1:]))
    bad = check(rec, args.max_rss_growth)
    rec["passed"], rec["failures"] = not bad, bad
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    growth = "n/a" if rec["rss_growth"] is None else f"{100 * rec['rss_growth']:.1f}%"
    print(f"soak: {rec['seconds']} s, {rec['waves']} waves, codes {rec['codes']}, leaked pages "
          f"{rec['leaked_pages']:.0f}, RSS growth after warm-up {growth}, p50/p99 "
          f"{rec['latency_p50_s']}/{rec['latency_p99_s']} s: {'passed' if not bad else bad}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
