"""The OpenAI-compatible HTTP API against the official `openai` client, on a live server on
127.0.0.1 over the embedded default model (with a chat template added): completions and chat,
streamed and not, n, logprobs, stop strings, seeds, usage, structured output, tool calls, error
statuses, a disconnect that frees pages; and guided rows that leave free rows' outputs alone."""

import http.client
import json
import re
import shutil
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from pallasite.model import default_model_path
from pallasite.serving.llm import LLM, SamplingParams
from pallasite.serving.server import BackgroundServer
from pallasite.serving.service import DRAINING, SERVING
from pallasite.serving.structured import StructuredOutput

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}\n"
            "{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = dict(temperature=0.0)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0,
                                                     "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("default_chat")
    for f in default_model_path().iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    llm = LLM(folder, max_model_len=128, num_pages=64, page_size=8, max_num_seqs=8,
              max_num_batched_tokens=32, token_buckets=[8, 32], page_buckets=[16])
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    srv = BackgroundServer(lambda: llm, "default", host="127.0.0.1", port=None, http_port=0,
                           grace_s=5).wait_ready(60)
    yield srv
    srv.drain(0)


@pytest.fixture(scope="module")
def base_url(server):
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_completions_match_the_library_and_count_usage(client, llm):
    want = llm.generate("The for statement", SamplingParams(max_tokens=12, **GREEDY))[0]
    r = client.completions.create(model="default", prompt="The for statement", max_tokens=12,
                                  **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "default"
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == want.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Streamed: the same text, and a usage chunk at the end.
    chunks = list(client.completions.create(model="default", prompt="The for statement",
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # Several prompts, as text and as token ids: one choice each, in order.
    ids = llm.tokenizer.encode("A list")
    r = client.completions.create(model="default", prompt=[ids, ids], max_tokens=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text


def test_chat_streamed_and_not(client, llm):
    messages = [{"role": "user", "content": "How do I raise an exception?"}]
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = llm.generate([ids], SamplingParams(max_tokens=10, **GREEDY))[0]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=10, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="default", messages=messages,
                                            max_completion_tokens=10, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_share_the_prompt_pages_and_seeds_repeat(client):
    prompt = "The for statement in Python iterates over the items of any sequence"
    ask = lambda: client.completions.create(model="default", prompt=prompt, max_tokens=8, n=3,
                                            temperature=1.0, seed=7)
    a, b = ask(), ask()
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # n seeded choices, not n copies
    assert a.usage.completion_tokens == 24
    assert a.usage.prompt_tokens_details.cached_tokens >= 8  # a full page shared


def test_logprobs(client):
    r = client.completions.create(model="default", prompt="Lists", max_tokens=5, logprobs=3,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)


def test_stop_string_ends_the_text(client):
    full = client.completions.create(model="default", prompt="The for statement", max_tokens=30,
                                     **GREEDY).choices[0].text
    stop = full[10:14]
    r = client.completions.create(model="default", prompt="The for statement", max_tokens=30,
                                  stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].stop_reason == stop  # vLLM's extra field


def test_json_schema_output_validates(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a list."}],
        max_tokens=80, response_format={"type": "json_schema",
                                        "json_schema": {"name": "thing", "schema": SCHEMA}},
        **GREEDY)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="default", prompt="A dict:", max_tokens=60, seed=3,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)


def test_guided_choice_and_regex_match(client):
    choices = ["for loop", "while loop", "recursion"]
    for seed in range(3):
        r = client.completions.create(model="default", prompt="Iterate with", max_tokens=10,
                                      seed=seed, extra_body={"guided_choice": choices})
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    r = client.completions.create(model="default", prompt="Code:", max_tokens=20, seed=1,
                                  extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


def test_named_tool_call_carries_schema_valid_arguments(client):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
        tool_choice="required", max_tokens=40, **GREEDY)
    if r.choices[0].finish_reason == "tool_calls":
        assert r.choices[0].message.tool_calls[0].function.name in ("get_weather", "noop")


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def error_of(fn):
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    return e.value.status_code, e.value.body


def test_errors_are_openai_error_objects(client, server):
    c = client.completions
    status, body = error_of(lambda: c.create(model="other", prompt="x"))
    assert status == 404 and body["param"] == "model" and "default" in body["message"]
    cases = [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
             (dict(logit_bias={"99999": 5}), "logit_bias"),
             (dict(extra_body={"echo": True}), "echo"),
             (dict(prompt="x " * 200), "prompt"), (dict(max_tokens=500), "max_tokens"),
             (dict(extra_body={"guided_regex": "(["}), "guided_regex"),
             (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"type": "nope"}}}}), "response_format"),
             (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
             (dict(n=0), "n")]
    for kwargs, param in cases:
        kwargs = {"model": "default", "prompt": "x", "max_tokens": 4, **kwargs}
        status, body = error_of(lambda: c.create(**kwargs))
        assert status == 400 and body["param"] == param and body["type"] == \
            "invalid_request_error", (kwargs, body)
        assert body["message"]
    service = server.service
    service.max_queue, saved = 0, service.max_queue
    try:
        assert error_of(lambda: c.create(model="default", prompt="x"))[0] == 429
    finally:
        service.max_queue = saved
    service.state = DRAINING
    try:
        assert error_of(lambda: c.create(model="default", prompt="x"))[0] == 503
        assert http_get(str(client.base_url).replace("/v1/", "/health"))[0] == 503
    finally:
        service.state = SERVING


def test_models_health_metrics(base_url, client):
    assert [m.id for m in client.models.list().data] == ["default"]
    assert http_get(base_url + "/health") == (200, '{"status":"serving"}')
    client.completions.create(model="default", prompt="x", max_tokens=1)  # whatever ran before
    status, metrics = http_get(base_url + "/metrics")
    assert status == 200 and 'method="Completions"' in metrics


def test_client_disconnect_mid_stream_frees_pages(base_url, llm, server):
    pages = llm.engine.pages
    before = pages.stats()["pages_used"]
    body = {"model": "default", "prompt": "The for statement", "max_tokens": 100,
            "stream": True, "ignore_eos": True, **GREEDY}
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    assert server.service.calls  # under way
    conn.close()  # the client goes away mid-stream
    deadline = time.time() + 30
    while (server.service.calls or pages.stats()["pages_used"] > before) and time.time() < deadline:
        time.sleep(0.05)
    assert not server.service.calls and pages.stats()["pages_used"] <= before


def test_guided_rows_leave_free_rows_unchanged(llm):
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The for statement", "A list is", "def f():", "Raise"]
    alone = llm.generate([prompts[0], prompts[2]], free)
    guided = [SamplingParams(max_tokens=40, temperature=0.0,
                             structured_output=StructuredOutput(json_schema=SCHEMA)),
              SamplingParams(max_tokens=16, temperature=0.0, logit_bias={5: 100.0})]
    mixed = llm.generate(prompts, [free, guided[0], free, guided[1]])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [a.token_ids for a in alone]
    assert set(mixed[3].token_ids) == {5}
    if mixed[1].finish_reason == "stop":
        jsonschema.validate(json.loads(mixed[1].text), SCHEMA)
