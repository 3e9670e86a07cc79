"""The OpenAI HTTP API's and structured output's costs, in one run (GPU, about 4 minutes):

    python -m benchmarks.bench_http --out DIR

1. `benchmarks.bench_structured` (its own process): a batch-64 decode step with every row
   JSON-schema-constrained against free, 8B-shaped model (`constrained_step_ratio`, <= 1.10).
2. `pallasite serve` on an 8B-shaped model (random bf16 weights) with gRPC and HTTP, and
   `benchmarks.bench_online --http`: the same Poisson load through both APIs
   (`ratio_vs_grpc`: HTTP/SSE output tokens/s over gRPC's, >= 0.95).

Writes DIR/http.json (both, with the targets) beside each part's own records.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, eos_token_id=128001)


def online(out: Path, args) -> list[dict]:
    model = out / "llama3_8b_shaped"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    serve = [sys.executable, "-m", "pallasite.serving.server", "--model", str(model),
             "--random-weights", "--host", "127.0.0.1", "--port", str(args.grpc_port),
             "--http-port", str(args.http_port), "--metrics-port", "-1",
             "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
             "--max-model-len", "2560", "--log-level", "WARNING"]
    log = open(out / "server.log", "w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        from benchmarks import bench_online
        return bench_online.main([
            "--server", f"127.0.0.1:{args.grpc_port}", "--http", f"127.0.0.1:{args.http_port}",
            "--rate", args.rate, "--num-requests", str(args.num_requests),
            "--duration", str(args.duration), "--max-wait", "20",
            "--input-len", "128:1024", "--output-len", "64:256",
            "--out", str(out / "online_http.json")])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rate", default="8", help="Poisson rate(s) for the online part")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--duration", type=float, default=25.0)
    ap.add_argument("--grpc-port", type=int, default=50051)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--skip-step", action="store_true", help="only the online comparison")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {}
    t0 = time.perf_counter()
    if not args.skip_step:
        done = subprocess.run([sys.executable, "-m", "benchmarks.bench_structured", "--out",
                               str(out)])
        if done.returncode == 0:
            step = json.loads((out / "structured.json").read_text())
            record["structured_step"] = step
            record["constrained_step_ratio"] = step["constrained_step_ratio"]
        else:
            print(f"the structured step benchmark failed (exit {done.returncode}); going on")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"no HTTP stack on this machine ({e}): the online comparison is skipped")
    else:
        runs = online(out, args)
        record["online"] = runs
        ratios = [r["ratio_vs_grpc"] for r in runs if r.get("api") == "http"]
        record["ratio_vs_grpc"] = min(ratios) if ratios else None
    record["targets"] = dict(constrained_step_ratio="<= 1.10", ratio_vs_grpc=">= 0.95")
    record["seconds"] = time.perf_counter() - t0
    (out / "http.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record.get(k) for k in ("constrained_step_ratio", "ratio_vs_grpc",
                                                 "seconds")}))


if __name__ == "__main__":
    main()
