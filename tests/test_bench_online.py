"""A short, bounded run of the online load generator against a loopback test server."""

import json
import time

from test_server import checkpoint, llm, server  # noqa: F401  (module fixtures, built anew here)

from benchmarks import bench_online


def check_sane(rec, requests):
    assert rec["requests"] == rec["completed"] == requests and rec["errors"] == {}
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p50, p90, p99 = (rec[f"{name}_p{q}"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, (name, p50, p90, p99)
    assert rec["ttft_ms_p50"] <= rec["e2e_ms_p50"]
    assert rec["request_per_s"] > 0 and rec["output_tok_per_s"] > 0
    assert rec["total_tok_per_s"] > rec["output_tok_per_s"]
    assert 0 <= rec["goodput_req_per_s"] <= rec["request_per_s"]


def test_rate_and_concurrency_runs(server, tmp_path):
    out = tmp_path / "online.json"
    records = bench_online.main([
        "--server", f"127.0.0.1:{server.port}", "--rate", "50,inf", "--num-requests", "12",
        "--input-len", "8:40", "--output-len", "4:12", "--out", str(out)])
    assert json.loads(out.read_text()) == records and [r["rate"] for r in records] == [50.0, "inf"]
    for rec in records:
        check_sane(rec, 12)
        assert 4 <= rec["mean_output_tokens"] <= 12
        assert rec["model"] == "tiny" and rec["max_num_seqs"] == 8
    [rec] = bench_online.main(["--server", f"127.0.0.1:{server.port}", "--concurrency", "3",
                               "--num-requests", "9", "--input-len", "16", "--output-len", "6"])
    check_sane(rec, 9)
    assert rec["mean_output_tokens"] == 6 and rec["concurrency"] == 3


def test_jsonl_prompts_and_bounds(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The quick brown fox"}\n'
                       '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}\n'
                       '{"token_ids": [5, 6, 7]}\n')
    [rec] = bench_online.main(["--server", f"127.0.0.1:{server.port}", "--concurrency", "2",
                               "--num-requests", "6", "--prompts", str(prompts),
                               "--output-len", "5"])
    check_sane(rec, 6)
    assert rec["mean_output_tokens"] == (5 + 3 + 5) / 3
    # Bounded in time: at 4 requests/s for 0.5 s only a few of the 1000 requests go out, and
    # a tight SLA leaves no goodput.
    t = time.monotonic()
    [rec] = bench_online.main(["--server", f"127.0.0.1:{server.port}", "--rate", "4",
                               "--num-requests", "1000", "--duration", "0.5", "--max-wait", "10",
                               "--input-len", "8", "--output-len", "4", "--slo-ttft-ms", "0"])
    assert time.monotonic() - t < 10 and 1 <= rec["requests"] <= 10
    assert rec["goodput_req_per_s"] == 0


def test_http_run_beside_grpc(llm):  # noqa: F811
    """--http: the same load through the OpenAI HTTP API of a server that serves both."""
    from pallasite.serving.server import BackgroundServer
    srv = BackgroundServer(lambda: llm, "tiny", host="127.0.0.1", port=0, http_port=0).wait_ready(60)
    try:
        grpc_rec, http_rec = bench_online.main([
            "--server", f"127.0.0.1:{srv.port}", "--http", f"127.0.0.1:{srv.server.http_port}",
            "--rate", "inf", "--num-requests", "6", "--input-len", "8:16", "--output-len", "4:8"])
    finally:
        srv.drain(0)
    assert (grpc_rec["api"], http_rec["api"]) == ("grpc", "http")
    check_sane(grpc_rec, 6)
    check_sane(http_rec, 6)
    assert http_rec["mean_output_tokens"] == grpc_rec["mean_output_tokens"]  # same lengths
    assert http_rec["ratio_vs_grpc"] == http_rec["output_tok_per_s"] / grpc_rec["output_tok_per_s"]
