"""The gRPC service against a real server on 127.0.0.1 (ephemeral ports) over a tiny checkpoint:
streams equal LLM.generate, concurrency, cancellation, disconnects and deadlines free their
pages, bad input gets its status, health and reflection, drain, metrics and the log line."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import tok_fixtures
from pallasite.serving.client import AsyncClient, Client, finish_reason, join
from pallasite.serving.llm import LLM, SamplingParams
from pallasite.serving.proto import SERVICE_NAME, pb
from pallasite.serving.server import BackgroundServer

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_MODEL_LEN = 256
ENGINE = dict(max_model_len=MAX_MODEL_LEN, num_pages=96, page_size=8, max_num_seqs=8,
              max_num_batched_tokens=64)
BUCKETS = dict(token_buckets=[8, 64], page_buckets=[32])  # few compilations: a quick warm-up


def save_checkpoint(folder):
    """A tiny random Llama with a trained byte-level BPE tokenizer and a chat template."""
    tok = tok_fixtures.byte_level(400)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        eos_token_id=tok.token_to_id("<|eos|>"), bos_token_id=tok.token_to_id("<|bos|>")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    tok_fixtures.save(tok, folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("server_model"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    llm = LLM(checkpoint, **ENGINE, **BUCKETS)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    srv = BackgroundServer(lambda: llm, "tiny", host="127.0.0.1", port=0, metrics_port=0,
                           grace_s=5).wait_ready(60)
    yield srv
    srv.drain(0)


@pytest.fixture(scope="module")
def client(server):
    with Client(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


@pytest.fixture
def slow_engine(llm, monkeypatch):
    """Each engine step takes at least 5 ms, so that a 200-token request lasts about a second."""
    step = llm.engine.step

    def slow_step():
        time.sleep(0.005)
        return step()
    monkeypatch.setattr(llm.engine, "step", slow_step)


def wait_until_idle(llm, server, timeout=10.0):
    """Every request gone from the engine and the service; no page held by a sequence."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.engine.stats()
        if (not llm.engine.seqs and not server.service.calls and stats["pages_used"] == 0
                and stats["running"] == stats["waiting"] == 0):
            return stats
        time.sleep(0.01)
    raise AssertionError(f"not idle after {timeout} s: {llm.engine.stats()}, "
                         f"calls {list(server.service.calls)}")


def scrape(server) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics",
                                  timeout=10).read().decode()


def metric(text: str, name: str, **labels) -> float:
    """A sample's value from a scrape (0 when absent, as a counter not yet incremented)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# -- generation ------------------------------------------------------------------------------
def test_stream_equals_llm_generate_and_unary_equals_stream(llm, client):
    cases = [("The quick brown fox", dict(max_tokens=12, **GREEDY)),
             ("def add(a, b):", dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
                                      ignore_eos=True, logprobs=3)),
             ("Lists, tuples", dict(max_tokens=8, temperature=1.2, top_k=20, seed=3,
                                     repetition_penalty=1.3, presence_penalty=0.5))]
    for prompt, kwargs in cases:
        want = llm.generate(prompt, SamplingParams(**kwargs))[0]
        chunks = list(client.stream(prompt, request_id="case", **kwargs))
        assert all(not c.finish_reason for c in chunks[:-1])
        got = join(chunks)
        assert list(got.token_ids) == want.token_ids and got.text == want.text
        assert finish_reason(got) == want.finish_reason
        assert got.usage.prompt_tokens == want.prompt_tokens == len(llm.tokenizer.encode(prompt))
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.request_id == "case"
        assert 0 <= got.timing.queue_time_s <= got.timing.ttft_s <= got.timing.e2e_s
        if kwargs.get("logprobs"):
            assert [lp.token_id for lp in got.logprobs] == want.token_ids
            for lp, ref in zip(got.logprobs, want.logprobs):
                assert lp.logprob == pytest.approx(ref.logprob, abs=1e-5)
                assert [t.token_id for t in lp.top] == [t for t, _ in ref.top]
        unary = client.generate(prompt, **kwargs)
        assert unary.text == got.text and unary.token_ids == got.token_ids
        assert unary.finish_reason == got.finish_reason and unary.usage == got.usage
        assert len(unary.logprobs) == len(got.logprobs)


def test_unary_call_takes_two_outputs(llm, server, client, monkeypatch):
    """A unary call asks the engine for its first token and the rest at its end (`quiet`): the
    stream's answer, its time to first token measured, the admission queue emptied."""
    seen, deliver = [], llm._loop._deliver

    def spy(*outs):  # on the engine thread, every output it hands over
        seen.extend((out.request_id, len(out.new_token_ids)) for out in outs)
        deliver(*outs)
    monkeypatch.setattr(llm._loop, "_deliver", spy)
    kwargs = dict(max_tokens=12, **GREEDY)
    unary = client.generate("The quick brown fox", **kwargs)
    stream = join(list(client.stream("The quick brown fox", **kwargs)))
    assert unary.token_ids == stream.token_ids and unary.text == stream.text
    assert [n for rid, n in seen if rid == unary.request_id] == [1, 11]
    assert [n for rid, n in seen if rid == stream.request_id] == [1] * 12
    assert 0 < unary.timing.ttft_s < unary.timing.e2e_s
    wait_until_idle(llm, server)
    assert server.service.queued == 0


def test_inbox_wakes_the_loop_once_a_burst():
    """Outputs put from the engine's thread reach their queues in order, with one wakeup of the
    event loop for all that arrive before it runs."""
    from pallasite.serving.service import Inbox

    async def main():
        loop, calls = asyncio.get_running_loop(), []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        inbox, queues = Inbox.of(loop), [asyncio.Queue() for _ in range(3)]
        assert Inbox.of(loop) is inbox
        burst = threading.Thread(target=lambda: [inbox.put(queues[i % 3], i) for i in range(30)])
        burst.start()
        burst.join()
        assert [[await q.get() for _ in range(10)] for q in queues] == [
            list(range(k, 30, 3)) for k in range(3)]
        assert len(calls) == 1
        inbox.put(queues[0], "later")  # the next burst wakes it again
        assert await queues[0].get() == "later" and len(calls) == 2
    asyncio.run(main())


def test_token_ids_and_chat_prompts(llm, client):
    ids = llm.tokenizer.encode("héllo wörld")
    want = llm.generate([ids], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert list(client.generate(ids, max_tokens=6, **GREEDY).token_ids) == want.token_ids

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    chat_ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert client.tokenize(chat) == chat_ids
    want = llm.generate([chat_ids], SamplingParams(max_tokens=6, **GREEDY))[0]
    got = client.generate(chat, max_tokens=6, **GREEDY)
    assert list(got.token_ids) == want.token_ids and got.usage.prompt_tokens == len(chat_ids)


def test_stop_string_and_eos(llm, client):
    free = client.generate("The quick", max_tokens=12, **GREEDY)
    stop = free.text[3:6]
    got = client.generate("The quick", max_tokens=12, stop=stop, **GREEDY)
    assert finish_reason(got) == "stop" and got.text == free.text[:free.text.index(stop)]
    streamed = join(client.stream("The quick", max_tokens=12, stop=stop, **GREEDY))
    assert got.stop_string == streamed.stop_string == stop  # what ended it
    assert free.WhichOneof("stop_reason") is None
    eos = int(llm.tokenizer.eos_token_ids[0])
    got = client.generate("The quick", max_tokens=12, stop_token_ids=[free.token_ids[2]],
                          **GREEDY)
    assert finish_reason(got) == "stop" and list(got.token_ids) == list(free.token_ids[:3])
    assert got.stop_token_id == free.token_ids[2]
    assert eos in client.model_info().eos_token_ids


def test_tokenize_detokenize_model_info(llm, client):
    ids = client.tokenize("The quick brown fox")
    assert ids == llm.tokenizer.encode("The quick brown fox")
    assert client.tokenize("fox", add_special_tokens=False) == llm.tokenizer.encode(
        "fox", add_special_tokens=False)
    assert client.detokenize(ids) == "The quick brown fox"
    assert client.detokenize(ids, skip_special_tokens=False).startswith("<|bos|>")
    info = client.model_info()
    assert (info.model_name, info.context_length, info.vocab_size, info.dtype) == (
        "tiny", MAX_MODEL_LEN, llm.config.vocab_size, "float32")
    assert info.has_chat_template and info.max_num_seqs == 8 and info.page_size == 8
    assert info.quantization == "" and info.speculative == ""  # plain weights, no speculation
    assert info.mesh and info.kv_cache_dtype == "float32"


def test_32_concurrent_streams(llm, server):
    prompts = [f"Python {i} is a language" if i % 2 else "def add(a, b):" * (1 + i % 5)
               for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    want = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths])

    async def one(client, prompt, n):
        chunks = [c async for c in client.stream(prompt, max_tokens=n, **GREEDY)]
        return join(chunks), len(chunks)

    async def run_all():
        async with AsyncClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(run_all())
    for (got, _), ref, n in zip(results, want, lengths):
        assert list(got.token_ids) == ref.token_ids and len(ref.token_ids) == n
        assert got.text == ref.text and finish_reason(got) == "length"
    assert max(chunks for _, chunks in results) > 1  # streamed, not sent whole
    wait_until_idle(llm, server)


# -- ending early ----------------------------------------------------------------------------
def test_cancel_mid_stream_frees_pages(llm, server, client, slow_engine):
    before = metric(scrape(server), "pallasite_request_errors_total", code="CANCELLED")
    stream = client.stream("The quick brown fox", max_tokens=200, **GREEDY)
    next(stream), next(stream)
    assert llm.engine.stats()["pages_used"] > 0
    stream.close()  # cancels the call
    wait_until_idle(llm, server)
    assert metric(scrape(server), "pallasite_request_errors_total", code="CANCELLED") == before + 1


def test_client_disconnect_frees_pages(llm, server, slow_engine, caplog):
    """A client process killed mid-stream: the server sees the connection go and aborts."""
    code = ("import sys; from pallasite.serving.client import Client\n"
            f"c = Client('127.0.0.1:{server.port}')\n"
            "for r in c.stream('The quick', max_tokens=200, temperature=0.0, ignore_eos=True):\n"
            "    print(len(r.token_ids), flush=True)\n")
    caplog.set_level("INFO", logger="pallasite.serving.requests")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip()  # tokens are flowing
        assert llm.engine.seqs
    finally:
        proc.kill()
        proc.wait()
    wait_until_idle(llm, server)
    line = request_log_lines(caplog)[-1]
    assert line["code"] == "CANCELLED" and line["completion_tokens"] < 200


def request_log_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "pallasite.serving.requests"]


def test_deadline_exceeded_frees_request(llm, server, client, slow_engine, caplog):
    caplog.set_level("INFO", logger="pallasite.serving.requests")
    for call in (lambda: client.generate("The quick", max_tokens=200, timeout=0.3, **GREEDY),
                 lambda: list(client.stream("The quick", max_tokens=200, timeout=0.3, **GREEDY))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until_idle(llm, server)
        line = request_log_lines(caplog)[-1]  # the server saw the deadline, not a finished run
        assert line["code"] == "DEADLINE_EXCEEDED" and line["completion_tokens"] < 200
    assert len(client.generate("The quick", max_tokens=3, **GREEDY).token_ids) == 3


# -- bad input --------------------------------------------------------------------------------
LONG = list(range(3, 3 + MAX_MODEL_LEN))
BAD = [  # (prompt, sampling, status, words the message must hold)
    ("hi", dict(temperature=-0.5), "INVALID_ARGUMENT", ["temperature", ">= 0"]),
    ("hi", dict(top_p=0.0), "INVALID_ARGUMENT", ["top_p", "(0, 1]"]),
    ("hi", dict(top_p=1.5), "INVALID_ARGUMENT", ["top_p", "(0, 1]"]),
    ("hi", dict(top_k=-1), "INVALID_ARGUMENT", ["top_k", ">= 0"]),
    ("hi", dict(max_tokens=0), "INVALID_ARGUMENT", ["max_tokens", ">= 1"]),
    ("hi", dict(logprobs=50), "INVALID_ARGUMENT", ["logprobs", "20"]),
    ([5, 100000], {}, "INVALID_ARGUMENT", ["token_ids[1]", "100000", "vocabulary"]),
    ([5, -1], {}, "INVALID_ARGUMENT", ["token_ids[1]", "-1"]),
    ("hi", dict(stop_token_ids=[99999]), "INVALID_ARGUMENT", ["stop_token_ids", "99999"]),
    ("", {}, "INVALID_ARGUMENT", ["text", "empty"]),
    ([], {}, "INVALID_ARGUMENT", ["token_ids", "empty"]),
    ("hi", dict(max_tokens=MAX_MODEL_LEN), "INVALID_ARGUMENT",
     ["max_tokens", str(MAX_MODEL_LEN), "context length"]),
    (LONG, {}, "INVALID_ARGUMENT", [str(MAX_MODEL_LEN), "context length"]),
    ("hi", dict(structured_output=pb.StructuredOutput(regex="([")), "INVALID_ARGUMENT",
     ["regex", "unclosed"]),
    ("hi", dict(structured_output=pb.StructuredOutput(json_schema="{")), "INVALID_ARGUMENT",
     ["json_schema"]),
    ("hi", dict(logit_bias={99999: 1.0}), "INVALID_ARGUMENT", ["logit_bias", "99999"]),
]


def test_structured_output_and_logit_bias(client):
    """The proto's structured_output and logit_bias reach the sampler."""
    r = client.generate("hi", max_tokens=20, seed=1,
                        structured_output=pb.StructuredOutput(regex="[0-9]{3}-[ab]{2}"))
    assert re.fullmatch("[0-9]{3}-[ab]{2}", r.text) and finish_reason(r) == "stop", r.text
    options = ["red", "green", "blue"]
    r = client.generate("hi", max_tokens=20, temperature=0.0, structured_output=pb.StructuredOutput(
        choice=pb.Choice(options=options)))
    assert r.text in options
    r = client.generate("hi", max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={7: 100.0})
    assert list(r.token_ids) == [7] * 4


@pytest.mark.parametrize("prompt, sampling, status, words", BAD,
                         ids=[f"{i}-{list(b[1]) or type(b[0]).__name__}" for i, b in enumerate(BAD)])
def test_bad_input_status(client, prompt, sampling, status, words):
    for call in (client.generate, lambda *a, **k: list(client.stream(*a, **k))):
        with pytest.raises(grpc.RpcError) as err:
            call(prompt, **sampling)
        assert err.value.code().name == status
        assert all(w in err.value.details() for w in words), err.value.details()
    assert len(client.generate("hi", max_tokens=2, **GREEDY).token_ids) == 2


def test_missing_prompt_and_detokenize_unknown_id(client):
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GenerateUnary(pb.GenerateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.detokenize([1, 10 ** 6])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(client.generate("hi", max_tokens=2, **GREEDY).token_ids) == 2


def test_full_admission_queue_is_resource_exhausted(server, client):
    server.service.max_queue = 0  # every new request finds the queue full
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue" in err.value.details() and "limit 0" in err.value.details()
    finally:
        server.service.max_queue = 1024
    assert len(client.generate("hi", max_tokens=2, **GREEDY).token_ids) == 2


# -- health, reflection, drain ----------------------------------------------------------------
def health_status(channel, service=SERVICE_NAME) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_reflection_lists_the_services(client):
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_health_warmup_serving_draining(llm):
    """A second server on the same LLM, whose loading waits for a signal: NOT_SERVING and
    UNAVAILABLE while warming up, SERVING after; while draining NOT_SERVING, new calls
    UNAVAILABLE, the call under way finishes; past the grace period a call is aborted."""
    release = threading.Event()
    srv = BackgroundServer(lambda: release.wait() and llm, host="127.0.0.1", port=0)
    with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
        assert health_status(c.channel) == health_status(c.channel, "") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as err:
            c.generate("hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "warming" in err.value.details()
        release.set()
        srv.wait_ready(30)
        assert health_status(c.channel) == "SERVING"

        step = llm.engine.step
        llm.engine.step = lambda: (time.sleep(0.005), step())[1]
        try:
            short = c.stream("The quick", max_tokens=40, **GREEDY)
            first = next(short)
            drain = threading.Thread(target=srv.run, args=(srv.server.drain(30),))
            drain.start()
            while srv.service.state != "draining":
                time.sleep(0.005)
            assert health_status(c.channel) == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                c.generate("hi", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = join([first, *short])
            assert finish_reason(rest) == "length" and len(rest.token_ids) == 40
            drain.join()
        finally:
            llm.engine.step = step
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    wait_until_idle(llm, srv)


def test_grace_period_over_aborts_the_rest(llm, slow_engine):
    srv = BackgroundServer(lambda: llm, host="127.0.0.1", port=0).wait_ready(30)
    with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
        stream = c.stream("The quick", max_tokens=200, **GREEDY)
        next(stream)
        drain = threading.Thread(target=srv.drain, args=(0.2,))
        drain.start()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        drain.join()
    wait_until_idle(llm, srv)


def test_serves_without_the_health_and_reflection_packages(llm, monkeypatch):
    """Where grpcio-health-checking and grpcio-reflection are missing, the server still serves,
    and the client's wait_ready falls back on ModelInfo."""
    import pallasite.serving.client as client_module
    import pallasite.serving.server as server_module
    monkeypatch.setattr(server_module, "health", None)
    monkeypatch.setattr(server_module, "reflection", None)
    srv = BackgroundServer(lambda: llm, host="127.0.0.1", port=0)
    try:
        with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
            assert c.wait_ready(30) and srv.loaded.done()
            with pytest.raises(grpc.RpcError) as err:
                health_status(c.channel)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            monkeypatch.setattr(client_module, "_health", lambda: None)
            assert c.health() == "SERVING"
            assert len(c.generate("hi", max_tokens=3, **GREEDY).token_ids) == 3
    finally:
        srv.drain(0)


# -- metrics and logs -------------------------------------------------------------------------
def test_metrics(llm, server, client):
    client.generate("The quick", max_tokens=5, **GREEDY)
    with pytest.raises(grpc.RpcError):
        client.generate("hi", temperature=-1)
    text = scrape(server)
    assert metric(text, "pallasite_time_to_first_token_seconds_count") >= 1
    assert metric(text, "pallasite_inter_token_latency_seconds_count") >= 4
    assert metric(text, "pallasite_request_latency_seconds_count") >= 1
    assert metric(text, "pallasite_generated_tokens_total") >= 5
    assert metric(text, "pallasite_request_errors_total", code="INVALID_ARGUMENT") >= 1
    assert metric(text, "pallasite_requests_total", code="OK", method="GenerateUnary") >= 1
    assert metric(text, "pallasite_kv_pages_total") == llm.engine.pages.num_pages
    assert metric(text, "pallasite_kv_cache_info", dtype="float32") == 1
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"pallasite_queue_depth", "pallasite_running_sequences", "pallasite_kv_pages_used",
            "pallasite_kv_pages_cached", "pallasite_prefix_hit_tokens_total"} <= names


def test_a_speculating_server_answers_as_plain_decoding_and_reports_acceptance(llm, checkpoint):
    """Prompt lookup behind the service: the same greedy tokens as the plain engine, the
    acceptance counts on the last message's Usage, the method in ModelInfo, and the counters
    in the metrics."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(checkpoint, speculative_config=spec, **ENGINE, **BUCKETS) as spec_llm:
        srv = BackgroundServer(lambda: spec_llm, "tiny-ngram", host="127.0.0.1", port=0,
                               metrics_port=0, grace_s=5).wait_ready(60)
        try:
            with Client(f"127.0.0.1:{srv.port}", timeout=60) as c:
                prompt = "one two three one two three one two three one two"
                want = llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))[0]
                got = join(c.stream(prompt, max_tokens=24, **GREEDY))
                unary = c.generate(prompt, max_tokens=24, **GREEDY)
                assert list(got.token_ids) == list(unary.token_ids) == want.token_ids
                proposed = got.usage.speculative_proposed_tokens
                assert proposed > 0 and 0 <= got.usage.speculative_accepted_tokens <= proposed
                assert unary.usage.speculative_proposed_tokens == proposed
                assert c.model_info().speculative.startswith("ngram")
            text = scrape(srv)
            stats = spec_llm.engine.stats()
            assert metric(text, "pallasite_spec_proposed_tokens_total") == stats[
                "spec_proposed_tokens"] >= 2 * proposed
            assert metric(text, "pallasite_spec_accepted_tokens_total") == stats[
                "spec_accepted_tokens"]
            assert metric(text, "pallasite_spec_mean_accepted_length") >= 1.0
        finally:
            srv.drain(0)


def test_one_json_log_line_per_request(client, caplog):
    caplog.set_level("INFO", logger="pallasite.serving.requests")
    client.generate("The quick", max_tokens=3, request_id="log-me", **GREEDY)
    lines = request_log_lines(caplog)
    assert len(lines) == 1
    line = lines[0]
    assert line["client_request_id"] == "log-me" and line["code"] == "OK"
    assert line["completion_tokens"] == 3 and line["finish_reason"] == "length"
    assert line["prompt_tokens"] > 0 and line["ttft_s"] <= line["e2e_s"]


# -- the process ------------------------------------------------------------------------------
def test_serve_process_drains_on_sigterm_and_exits_0(checkpoint):
    args = ["--model", str(checkpoint), "--host", "127.0.0.1", "--port", "0", "--metrics-port",
            "-1", "--max-model-len", "128", "--num-pages", "32", "--page-size", "8",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--token-buckets", "8,32",
            "--page-buckets", "16", "--grace-period", "20", "--http-port", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "pallasite.serving.server", *args],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.split("127.0.0.1:")[1].split(",")[0].split(";")[0])
        http_port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        with Client(f"127.0.0.1:{port}", timeout=60) as c:
            c.wait_ready(120)
            assert c.model_info().model_name == checkpoint.name
            # The OpenAI HTTP API of the same process is up too.
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as r:
                assert r.status == 200
            stream = c.stream("The quick", max_tokens=60, **GREEDY)
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = join([first, *stream])  # the call under way still finishes
            assert finish_reason(rest) == "length" and len(rest.token_ids) == 60
        assert proc.wait(60) == 0
        assert "draining" in proc.stdout.read()
    finally:
        proc.kill()
