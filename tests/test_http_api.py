"""The HTTP front of `stemma serve`, driven by the official `openai` client (sync and async), on a
tiny random llama with a ByteLevel tokenizer (so constrained decoding works), in a subprocess.
Greedy outputs are compared with the in-process Engine on the same checkpoint."""
import asyncio
import json
import re
import time

import httpx2
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import stemma
from stemma.sampling_params import SamplingParams
from tests.bytelevel_tokenizer import build_tiny_bytelevel
from tests.served import ENGINE, HttpServed

KEY = "http-s3cret"
BODY_LIMIT = 64 * 1024
TINY = ("--served-model-name", "tiny")
PROMPT = "The date is 2024"
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_bytelevel(tmp_path_factory.mktemp("http_bytelevel")))


@pytest.fixture(scope="module")
def server(folder):
    served = HttpServed(folder, "--api-key", KEY, "--max-frame-bytes", str(BODY_LIMIT), *TINY)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(folder):
    return stemma.Engine(folder, **ENGINE)


def http(server, method, path, **kw):
    headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
    return httpx2.request(method, server.url + path, headers=headers, timeout=60, **kw)


def info(server) -> dict:
    return http(server, "GET", "/get_server_info").json()


def wait_idle(server, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = info(server)["stats"]
        if stats["running"] == 0 and stats["queue"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the server is still busy: {stats}"
        time.sleep(0.05)


def greedy(max_tokens=12, **kw):
    return dict(max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **kw})


# ---------------------------------------------------------------- completions

def test_completion_equals_the_in_process_engine(client, engine):
    ref = engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    out = client.completions.create(model="tiny", prompt=PROMPT, **greedy())
    (choice,) = out.choices
    assert choice.text == ref.text and choice.finish_reason == "length"
    ids = engine.tokenizer(PROMPT).input_ids
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(ids) + 12
    assert out.model == "tiny" and out.object == "text_completion"
    by_ids = client.completions.create(model="tiny", prompt=ids, **greedy())
    assert by_ids.choices[0].text == ref.text


def test_completion_stream_and_include_usage(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, **greedy(16))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **greedy(16)))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]


def test_completion_n2_and_several_prompts(client):
    out = client.completions.create(model="tiny", prompt=[PROMPT, "hello world"], n=2,
                                    max_tokens=8, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text != out.choices[1].text or out.choices[2].text != out.choices[3].text
    again = client.completions.create(model="tiny", prompt=[PROMPT, "hello world"], n=2,
                                      max_tokens=8, temperature=1.0, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=8,
                                              temperature=1.0, seed=11, stream=True))
    texts = ["", ""]
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in out.choices[:2]]


def test_completion_logprobs_match_the_engine(client, engine):
    ref = engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True,
                                                 logprobs=True, top_logprobs=3))
    out = client.completions.create(model="tiny", prompt=PROMPT, logprobs=3, **greedy(6))
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert len(lp.tokens) == 6 and all(len(top) <= 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the best one


def test_echo_scores_the_prompt(client, engine):
    ids = engine.tokenizer(PROMPT).input_ids
    ref = engine.generate(ids, SamplingParams(max_new_tokens=0, logprob_start=0))
    out = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == PROMPT
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    with_gen = client.completions.create(model="tiny", prompt=PROMPT, echo=True, **greedy(4))
    plain = client.completions.create(model="tiny", prompt=PROMPT, **greedy(4))
    assert with_gen.choices[0].text == PROMPT + plain.choices[0].text


def test_stop_list(client):
    free = client.completions.create(model="tiny", prompt=PROMPT, **greedy(24))
    text = free.choices[0].text
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), text
    out = client.completions.create(model="tiny", prompt=PROMPT, stop=["\u2603", stop], **greedy(24))
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


# ---------------------------------------------------------------- chat

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]


def test_chat_equals_the_engine_on_the_plain_fallback(client, engine):
    # the tiny tokenizer has no chat template: the frontend's plain format, ended at "\nUser:";
    # text parts joined by newlines (vLLM)
    prompt = "System: be brief\nUser: hello \nworld\nAssistant: "
    ref = engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True,
                                                 stop=["\nUser:", "\nSystem:"]))
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, **greedy(10))
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(engine.tokenizer(prompt).input_ids)
    assert out.object == "chat.completion"


def test_chat_stream_n2_logprobs_and_usage(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True,
                                           top_logprobs=2, **greedy(8))
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
               for t in content)
    joined = b"".join(bytes(t.bytes) for t in content)  # each token's own bytes (not its text's)
    assert joined.decode("utf-8", "replace") == plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **greedy(8)))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 2 * plain.usage.completion_tokens
    texts = ["", ""]
    for c in body:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts == [plain.choices[0].message.content] * 2  # greedy: both the same
    assert body[0].choices[0].delta.role == "assistant"


def test_chat_stop_list(client):
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, **greedy(20)).choices[0]
    text = free.message.content
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), text
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, stop=[stop, "\u2603"],
                                         **greedy(20)).choices[0]
    assert out.finish_reason == "stop" and out.message.content == text[:text.index(stop)]


def test_json_schema_response_format(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a person as JSON"}], max_tokens=60,
        temperature=0.8, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": JSON_SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), JSON_SCHEMA)
    obj = client.completions.create(model="tiny", prompt="{", max_tokens=40, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_async_client_concurrently(server, client):
    reference = [client.completions.create(model="tiny", prompt=p, **greedy(8)).choices[0].text
                 for p in ("hello", "the quick", "1+2")]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        plain = await asyncio.gather(*[aclient.completions.create(model="tiny", prompt=p, **greedy(8))
                                       for p in ("hello", "the quick", "1+2")])
        stream = await aclient.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                       **greedy(8))
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await aclient.close()
        return [o.choices[0].text for o in plain], text

    texts, chat_text = asyncio.run(main())
    assert texts == reference
    assert chat_text == client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                       **greedy(8)).choices[0].message.content


# ---------------------------------------------------------------- the rest of the API

def test_models_health_tokenize_flush(server, client, engine):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx2.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    tok = http(server, "POST", "/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == engine.tokenizer(PROMPT).input_ids and tok["count"] == len(tok["tokens"])
    assert http(server, "POST", "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith(PROMPT)
    wait_idle(server)
    assert http(server, "POST", "/flush_cache").json()["ok"] is True
    assert info(server)["stats"]["pool_cached"] == 0


def test_usage_reports_cached_tokens(client):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    client.completions.create(model="tiny", prompt=prompt, **greedy(2))
    again = client.completions.create(model="tiny", prompt=prompt, **greedy(2))
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


def test_native_generate_keeps_salted_prompts_apart(server):
    """/generate's salt keeps a prompt's cached KV to requests of the same salt, as over ZeroMQ."""
    prompt = "a salted prompt that no other test sends, long enough to cache a few pages " * 2

    def cached(salt):
        out = http(server, "POST", "/generate", json={"text": prompt, "salt": salt,
                                                       "sampling_params": {"max_new_tokens": 2}})
        assert out.status_code == 200, out.text
        return out.json()["meta"]["cached_tokens"]
    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") > 0


def assert_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_errors_are_openai_error_objects(server):
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert_error(httpx2.post(server.url + "/v1/completions", json=ok), 401)
    assert_error(http(server, "POST", "/v1/completions", json=ok,
                      headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "model": "gpt-9"}), 404, "model")
    assert_error(http(server, "GET", "/v2/nothing"), 404)
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "temperature": -1}), 400, "temperature")
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "top_k": 0}), 400, "top_k")
    for key in ("x", "--5", "\u00b2", "1" * 5000):  # "--5", "²" and 5,000 digits were 500s: int() refused them
        assert_error(http(server, "POST", "/v1/completions", json={**ok, "logit_bias": {key: 1}}), 400, "logit_bias")
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "regex": "a+", "guided_regex": "b+"}),
                 400, "guided_regex")
    assert_error(http(server, "POST", "/v1/completions", json={"model": "tiny"}), 400, "prompt")
    # refused by the engine, not the HTTP layer: its reply names the field (protocol version 5)
    for extra, param in (({"logit_bias": {"999999": 1}}, "logit_bias"), ({"regex": "[0-9"}, "regex"),
                         ({"guided_regex": "[0-9"}, "guided_regex"), ({"stop": ["s%d" % i for i in range(65)]}, "stop"),
                         ({"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
                          "response_format")):
        assert_error(http(server, "POST", "/v1/completions", json={**ok, **extra}), 400, param)
    assert_error(http(server, "POST", "/v1/completions", content=b"{not json",
                      headers={"Content-Type": "application/json"}), 400)
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "prompt": "x" * (2 * BODY_LIMIT)}), 413)
    big = json.dumps({**ok, "prompt": "x" * (2 * BODY_LIMIT)}).encode()
    chunked = http(server, "POST", "/v1/completions", content=iter([big[:1000], big[1000:]]),
                   headers={"Content-Type": "application/json"})  # no Content-Length: it was a 400
    assert chunked.request.headers.get("transfer-encoding") == "chunked"
    assert assert_error(chunked, 413)["code"] == "too_large"
    assert_error(http(server, "POST", "/v1/chat/completions",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                 400, "response_format.json_schema")
    assert_error(http(server, "POST", "/v1/chat/completions",  # found by schemathesis: was a 500
                      json={"model": "tiny", "messages": [{"role": "tool", "content": None}],
                            "add_generation_prompt": False}), 400, "messages.0.role")
    assert_error(http(server, "POST", "/v1/completions", json={**ok, "prompt": []}), 400, "prompt")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert_error(http(server, "POST", "/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400,
                 "top_logprobs")  # as OpenAI: top_logprobs needs logprobs: true
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": {"type": "function", "function": {"name": "g"}}},
                   {"tool_choice": {"type": "function", "function": ["f"]}}, {"tool_choice": "any"},
                   {"tool_choice": "required", "response_format": {"type": "json_object"}}):
        assert_error(http(server, "POST", "/v1/chat/completions", json={**chat, "tools": tools, **choice}),
                     400, "tool_choice")  # "auto" needs a tool-call parser: refused, not silently ignored
    assert_error(http(server, "POST", "/v1/chat/completions", json={**chat, "tool_choice": "required"}),
                 400, "tool_choice")
    assert_error(http(server, "POST", "/v1/chat/completions", json={**chat, "tools": [{"type": "function"}],
                                                                   "tool_choice": "required"}), 400, "tools[0]")
    assert http(server, "POST", "/v1/chat/completions",
                json={**chat, "tools": tools, "tool_choice": "none"}).status_code == 200
    dangling = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nope"}}}}}]
    for stream in (False, True):  # the forced call's schema does not build: a 400 with the reason
        error = assert_error(http(server, "POST", "/v1/chat/completions",
                                  json={**chat, "tools": dangling, "stream": stream,
                                        "tool_choice": {"type": "function", "function": {"name": "f"}}}), 400)
        assert "Invalid reference path" in error["message"]
    assert http(server, "POST", "/v1/completions", json=ok).status_code == 200  # still serving


def test_a_stream_the_engine_refuses_gets_its_status(server, client):
    """As a vLLM server answers: the 400 of a refused request, not a 200 and then an error event."""
    bad = {"max_tokens": 4, "stream": True, "stop_token_ids": [10 ** 9]}  # outside the vocabulary
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        error = assert_error(http(server, "POST", path, json={"model": "tiny", **body, **bad}), 400)
        assert "stop_token_ids" in error["message"]
    native = http(server, "POST", "/generate", json={"input_ids": [5, 6], "stream": True,
                                                     "sampling_params": {"stop_token_ids": [10 ** 9]}})
    assert native.status_code == 400 and "stop_token_ids" in native.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model="tiny", prompt=PROMPT, stream=True, max_tokens=4,
                                  extra_body={"stop_token_ids": [10 ** 9]})
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, **greedy(4)))
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1  # a good stream streams


def test_null_means_the_default(server):
    """Clients that send every field, unset ones as null, are served as OpenAI and vLLM serve
    them; a null max_tokens keeps its meaning (as long as the context allows)."""
    nulls = dict.fromkeys(["n", "stream", "stream_options", "stop", "seed", "logit_bias", "user",
                           "response_format", "top_k", "ignore_eos", "best_of", "suffix"])
    out = http(server, "POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                       "temperature": 0, "echo": None, "logprobs": None,
                                                       **nulls})
    assert out.status_code == 200, out.text
    (choice,) = out.json()["choices"]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    chat = http(server, "POST", "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": 3,
        "logprobs": None, "top_logprobs": None, "add_generation_prompt": None, "tools": None,
        "tool_choice": None, "stream_options": {"include_usage": None}, **nulls})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1
    assert_error(http(server, "POST", "/v1/completions", json={"model": "tiny", "prompt": None}), 400, "prompt")


def test_seeds_and_logprobs_as_openai_takes_them(client):
    """Any 64-bit seed; `logprobs: 0` lists the chosen token alone (OpenAI, vLLM)."""
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0,
                                         seed=seed).choices[0].text for seed in (-1, -1, -2)]
    assert sampled[0] == sampled[1]
    out = client.completions.create(model="tiny", prompt=PROMPT, logprobs=0, **greedy(4)).choices[0]
    lp = out.logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [top[t] for top, t in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs


def test_vllm_guided_fields(client):
    picks = ["yes", "no (maybe)", "a|b.c"]
    for seed in range(3):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                        seed=seed, extra_body={"guided_choice": picks})
        assert out.choices[0].text in picks
    regex = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1,
                                      extra_body={"guided_regex": r"\d{3}"})
    assert re.fullmatch(r"\d{3}", regex.choices[0].text)
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                         max_tokens=60, temperature=0.8, seed=2,
                                         extra_body={"guided_json": JSON_SCHEMA})
    jsonschema.validate(json.loads(obj.choices[0].message.content), JSON_SCHEMA)


def test_a_streamed_echo_with_logprobs_reads_its_prompt_from_the_cache(client):
    """A streamed echo is the prompt's text only, so its prompt is not scored: the cache serves it
    (scoring it would bypass the cache, and refuse prompts past max_prompt_logprobs)."""
    prompt = "a streamed echo keeps its prompt in the cache " * 3

    def usage():
        chunks = list(client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1,
                                                stream=True, stream_options={"include_usage": True},
                                                **greedy(2)))
        assert "".join(c.choices[0].text for c in chunks[:-1]).startswith(prompt)
        return chunks[-1].usage
    usage()
    again = usage()
    assert again.prompt_tokens_details.cached_tokens >= again.prompt_tokens - 1


def test_a_stop_token_s_text_is_left_out(client, engine):
    ids = engine.tokenizer(PROMPT).input_ids
    third = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)).token_ids[2]
    two = client.completions.create(model="tiny", prompt=PROMPT, **greedy(2)).choices[0].text
    out = client.completions.create(model="tiny", prompt=PROMPT, **greedy(8, stop_token_ids=[third]))
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3
    assert out.choices[0].text == two
    chunks = client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                       **greedy(8, stop_token_ids=[third]))
    assert "".join(c.choices[0].text for c in chunks) == two
    kept = client.completions.create(model="tiny", prompt=PROMPT,  # vLLM's field
                                     **greedy(8, stop_token_ids=[third], include_stop_str_in_output=True))
    assert kept.choices[0].text == client.completions.create(model="tiny", prompt=PROMPT, **greedy(3)).choices[0].text


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
          "required": ["query"], "additionalProperties": False}
PLACE = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "required": ["at"],
         "additionalProperties": False,  # as pydantic writes nested models: "$ref" into "$defs"
         "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                             "required": ["city"], "additionalProperties": False}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "the web", "parameters": SEARCH}},
         {"type": "function", "function": {"name": "place", "parameters": PLACE}}]
ASK = [{"role": "user", "content": "the weather in Paris?"}]


def test_a_named_tool_choice_returns_its_call(client):
    for seed in range(2):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                             temperature=0.8, seed=seed,
                                             tool_choice={"type": "function", "function": {"name": "weather"}})
        message = out.choices[0].message
        (call,) = message.tool_calls
        assert out.choices[0].finish_reason == "stop"  # a named call ends as a plain reply (vLLM, OpenAI)
        assert message.content is None and call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                                 temperature=0, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "search"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    (delta,) = deltas
    (call,) = delta.tool_calls
    assert call.index == 0 and call.function.name == "search"
    jsonschema.validate(json.loads(call.function.arguments), SEARCH)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_required_tool_choice_returns_calls_of_the_tools(client):
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120,
                                             temperature=0.9, seed=seed, tool_choice="required")
        calls = out.choices[0].message.tool_calls
        assert calls and out.choices[0].finish_reason == "tool_calls", out.choices[0]
        for call in calls:
            schema = {"weather": WEATHER, "search": SEARCH, "place": PLACE}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    place = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "place"}})
    jsonschema.validate(json.loads(place.choices[0].message.tool_calls[0].function.arguments), PLACE)
    cut = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=3,
                                         temperature=0, tool_choice="required").choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None and cut.message.content
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # the tiny tokenizer has no chat template: the plain fallback refuses the turns it cannot
    # render (it dropped them from the prompt)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert refused.value.body["param"] == f"messages.{len(ASK)}.tool_calls"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=history[:len(ASK)] + history[-1:], max_tokens=4)
    assert refused.value.body["param"] == f"messages.{len(ASK)}.role"


def test_tool_turns_reach_the_template_as_templates_take_them():
    """Arguments as objects (vLLM hands them so: templates write them with tojson), the tool
    turn's call id kept."""
    from stemma.serve.http.chat import as_dicts
    from stemma.serve.http.openai_models import ChatCompletionRequest
    deep = "[" * 5000  # json.loads raises RecursionError, not ValueError: it was a 500
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"id": "c3", "type": "function", "function": {"name": "h", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok", "name": "f"}]
    turns = as_dicts(ChatCompletionRequest(model="tiny", messages=history).messages)
    assert [c["function"]["arguments"] for c in turns[0]["tool_calls"]] == [{"x": [1, 2]}, "not json", deep]
    assert turns[1] == {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"}


def test_required_calls_are_strict_json_or_text():
    from stemma.serve.http.errors import ApiError
    from stemma.serve.http.tools import forced_tools
    required = forced_tools(TOOLS, "required")
    assert set(required.schema["$defs"]) == {"Place"}  # hoisted: "#/$defs/Place" resolves at the root
    (call,) = required.calls('[{"name": "search", "parameters": {"query": "x"}}]')
    assert json.loads(call["function"]["arguments"]) == {"query": "x"}
    assert required.calls('[{"name": "f", "parameters": {"x": 1e999}}]') is None  # inf is not JSON
    assert required.calls("[" * 5000) is None
    other = {**PLACE, "$defs": {"Place": {"type": "string"}}}
    with pytest.raises(ApiError, match="define \\$defs/Place differently"):
        forced_tools(TOOLS + [{"type": "function", "function": {"name": "other", "parameters": other}}],
                     "required")


def test_chat_ignore_eos_runs_past_the_turn_s_end():
    from stemma.lang.chat_template import PLAIN
    from stemma.serve.http.chat import stops_of
    from stemma.serve.http.openai_models import ChatCompletionRequest
    req = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], stop="END", stop_token_ids=[7])
    stops, ids = stops_of(ChatCompletionRequest(**req), PLAIN)
    assert stops == ["END", *PLAIN.stop] and ids == [7]
    assert stops_of(ChatCompletionRequest(**req, ignore_eos=True), PLAIN) == (["END"], [7])


def test_logit_bias_and_extra_fields(client, engine):
    forced = engine.tokenizer("Paris", add_special_tokens=False).input_ids[0]
    free = client.completions.create(model="tiny", prompt=PROMPT, **greedy(3))
    biased = client.completions.create(model="tiny", prompt=PROMPT, logit_bias={str(forced): 100},
                                       **greedy(3))
    assert biased.choices[0].text == engine.tokenizer.decode([forced] * 3) != free.choices[0].text
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9,
                                    extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                                "min_tokens": 12, "stop_token_ids": [0]})
    assert out.usage.completion_tokens == 12
    regex = client.completions.create(model="tiny", prompt="The phone number is", max_tokens=20,
                                      temperature=0.7, extra_body={"regex": r" \(\d{3}\) \d{3}"})
    assert regex.choices[0].text[0] == " " and len(regex.choices[0].text) == 10


def test_program_context_as_an_extra_field_and_end_program(server, client):
    call = {"program_id": "http-agent", "call_index": 0, "pause_s": 0.2}
    out = client.completions.create(model="tiny", prompt=PROMPT, **greedy(3, program_call=call))
    assert out.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          **greedy(2, program_call={**call, "call_index": 1}))
    assert chat.usage.completion_tokens == 2
    native = http(server, "POST", "/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "program_call": {**call, "call_index": 2}})
    assert native.status_code == 200, native.text
    record = next(p for p in wait_idle(server)["programs"] if p["program_id"] == "http-agent")
    assert record["calls"] == 3 and not record["ended"]
    assert http(server, "POST", "/end_program", json={"program_id": "http-agent"}).json() == {"ok": True}
    deadline = time.monotonic() + 10
    while not next(p for p in info(server)["stats"]["programs"] if p["program_id"] == "http-agent")["ended"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError, match="call_index"):
        client.completions.create(model="tiny", prompt=PROMPT,
                                  **greedy(2, program_call={"program_id": "x", "call_index": -1}))
    bad = http(server, "POST", "/end_program", json={"program_id": ""})
    assert bad.status_code in (400, 422)


def test_a_disconnected_stream_frees_its_kv(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx2.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert info(server)["stats"]["running"] == 1
    stats = wait_idle(server)  # aborted, not run to its 1500 tokens
    assert stats["pool_whole"] and stats["generated_tokens"] < 10_000


def test_a_client_gone_before_its_answer_has_its_request_aborted(server):
    before = wait_idle(server)["generated_tokens"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(server.url + "/v1/completions",
                    json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    stats = wait_idle(server)
    assert stats["pool_whole"] and stats["generated_tokens"] - before < 1500


# ---------------------------------------------------------------- metrics

def scrape(server) -> dict[str, float]:
    text = httpx2.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())
                                        if k != "le")
            if "le" in sample.labels:
                continue
            out[key] = sample.value
    return out


def test_metrics_count_exactly_what_ran(server, client):
    wait_idle(server)
    before = scrape(server)
    lengths = [3, 5, 1, 7]
    cached = sum(client.completions.create(model="tiny", prompt=f"hello {i}", **greedy(n))
                 .usage.prompt_tokens_details.cached_tokens for i, n in enumerate(lengths))
    prompt_tokens = sum(len(http(server, "POST", "/tokenize", json={"prompt": f"hello {i}"}).json()["tokens"])
                        for i in range(4))
    after = scrape(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    p = "stemma:"
    assert delta(p + "e2e_request_latency_seconds_count") == 4
    assert delta(p + "time_to_first_token_seconds_count") == 4
    assert delta(p + "request_queue_time_seconds_count") == 4
    assert delta(p + "inter_token_latency_seconds_count") == sum(n - 1 for n in lengths)
    assert delta(p + "generation_tokens_total") == sum(lengths)
    assert delta(p + "prompt_tokens_total") == prompt_tokens
    assert delta(p + "cached_tokens_total") == cached > 0
    assert delta(p + "request_success_total{finished_reason=length}") == 4
    assert delta(p + "num_aborted_requests_total") == 0
    time.sleep(1.2)  # the gauges follow the engine's stats, polled once a second
    gauges = scrape(server)
    assert gauges[p + "num_requests_running"] == 0 and 0 < gauges[p + "cache_hit_rate"] <= 1
    # an idle server's cached KV is evictable: free, as vLLM's gauge counts it (it read the tree's share)
    assert gauges[p + "kv_cache_usage_perc"] == 0 and info(server)["stats"]["pool_usage"] > 0


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* shows them) listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, _, state = line.split()[1:4]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    out.add(address)
    return out


def test_server_without_key_binds_loopback_and_stops_cleanly(folder):
    served = HttpServed(folder, *TINY)
    # the HTTP front is up before the model: until then /health said 503, with the error object
    assert 503 in served.health_seen and set(served.health_seen) <= {503, 200}
    try:
        r = httpx2.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200
        assert listening_addresses(served.port) == {"0100007F"}  # 127.0.0.1 only
    finally:
        assert served.stop() == 0


def test_tokenize_renders_messages_as_chat_does(folder):
    """`/tokenize` with messages counts what chat would send: the tools and a continued final
    message rendered by the template too (tools were dropped, so a template that writes them
    counted fewer tokens than chat's prompt)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from stemma.serve.http import native
    from stemma.serve.http.chat import render
    from stemma.serve.http.openai_models import TokenizeRequest
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    state = SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(context_length=4096),
                            check_ready=lambda: None, model_names=lambda: ["tiny"])
    plain = native.tokenize(state, TokenizeRequest(messages=ASK))
    with_tools = native.tokenize(state, TokenizeRequest(messages=ASK, tools=TOOLS))
    assert with_tools["tokens"] == render(state, ASK, tools=TOOLS)[0]
    assert with_tools["count"] > plain["count"] + 10
    reply = ASK + [{"role": "assistant", "content": "It is"}]
    continued = native.tokenize(state, TokenizeRequest(messages=reply, continue_final_message=True,
                                                       add_generation_prompt=False))
    assert continued["tokens"] == render(state, reply, False, True)[0]


def test_tokenize_with_no_messages_to_continue_is_not_an_internal_error(folder):
    """schemathesis found it: `/tokenize` with `messages: []` and `continue_final_message`
    answered 500 (the plain format read the last message of none)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from stemma.serve.http import native
    from stemma.lang.chat_template import PLAIN
    from stemma.serve.http.errors import ApiError
    from stemma.serve.http.openai_models import TokenizeRequest
    tok = AutoTokenizer.from_pretrained(folder)
    state = SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(context_length=4096),
                            check_ready=lambda: None, model_names=lambda: ["tiny"])
    assert tok.chat_template is None  # the frontend's plain format: nothing to continue, so the
    empty = native.tokenize(state, TokenizeRequest(messages=[], continue_final_message=True))
    assert empty["tokens"] == tok(PLAIN.prefix("assistant")).input_ids  # assistant's turn starts
    state.tokenizer = tok = AutoTokenizer.from_pretrained(folder)  # (templates are cached by it)
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ApiError) as caught:  # a template's own refusal is the client's error
        native.tokenize(state, TokenizeRequest(messages=[], continue_final_message=True))
    assert caught.value.param == "messages"


def test_a_constraint_that_fails_later_is_reported_under_the_field_that_asked_for_it():
    """A constraint whose compile outlasts the engine's check fails its request later: the
    error names the field the user set (tool_choice for a forced call, not response_format)."""
    from stemma.protocol import messages as P
    from stemma.serve.http.errors import ApiError
    from stemma.serve.http.generation import Prompt, Run, _raise_for
    failed = P.Finished(rid="r", token_ids=[], finish_reason="error", meta={"error": "too complex"})
    params = SamplingParams(json_schema=json.dumps(WEATHER))
    for constraint, field in ((None, "response_format"), ("tool_choice", "tool_choice")):
        run = Run(peer=None, prompts=[Prompt([1])], params=params, stream=False, constraint=constraint)
        with pytest.raises(ApiError) as caught:
            _raise_for(run, failed)
        assert (caught.value.param, caught.value.message) == (field, "too complex")


# ---------------------------------------------------------------- vLLM's fields and limits

def context_of(server) -> int:
    return http(server, "GET", "/v1/models").json()["data"][0]["max_model_len"]


def test_completion_top_logprobs_list_the_sampled_token(client):
    """A token sampled outside the top k is listed beside them (OpenAI, vLLM: up to logprobs + 1)."""
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=2.0, seed=1,
                                    logprobs=1, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and len(top) <= 2
        if "\ufffd" not in token:  # pieces of one character read alike: the likelier is listed
            assert top[token] == pytest.approx(logprob)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # at temperature 2, some were


def test_text_parts_of_a_message_are_joined_by_newlines(server):
    def tokens(content):
        reply = http(server, "POST", "/tokenize", json={"messages": [{"role": "user", "content": content}]})
        return reply.json()["tokens"]
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert tokens(parts) == tokens("Hello\nworld")  # vLLM's join


def test_max_tokens_past_the_context_is_refused_and_null_takes_what_is_left(server):
    context = context_of(server)
    prompt = [5] * (context - 10)
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "ignore_eos": True}
    error = assert_error(http(server, "POST", "/v1/completions", json={**body, "max_tokens": 11}), 400, "max_tokens")
    assert f"{context} tokens" in error["message"]
    fits = http(server, "POST", "/v1/completions", json={**body, "max_tokens": 10})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 10
    last = http(server, "POST", "/v1/completions", json={**body, "prompt": [5] * (context - 1), "max_tokens": None})
    assert last.status_code == 200 and last.json()["usage"]["completion_tokens"] == 1, last.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http(server, "POST", "/v1/chat/completions", json={**chat, "max_completion_tokens": context}),
                 400, "max_completion_tokens")
    assert_error(http(server, "POST", "/v1/chat/completions", json={**chat, "max_tokens": context}), 400, "max_tokens")


def test_stop_reason_names_the_stop_string(client):
    text = client.completions.create(model="tiny", prompt=PROMPT, **greedy(12)).choices[0].text
    stop = text[3:6]
    assert stop and text.index(stop) == 3
    by_string = client.completions.create(model="tiny", prompt=PROMPT, stop=[stop], **greedy(12)).choices[0]
    assert (by_string.finish_reason, by_string.text, by_string.model_extra["stop_reason"]) == ("stop", text[:3], stop)
    plain = client.completions.create(model="tiny", prompt=PROMPT, **greedy(12)).choices[0]
    assert plain.finish_reason == "length" and plain.model_extra["stop_reason"] is None
    # chat, streamed: the finishing chunk carries it
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    said = client.chat.completions.create(**chat).choices[0].message.content
    stop = said[2:5]
    assert stop and said.index(stop) == 2
    stream = list(client.chat.completions.create(**chat, stream=True, stop=[stop]))
    finals = [c.choices[0] for c in stream if c.choices and c.choices[0].finish_reason]
    assert [(f.finish_reason, f.model_extra["stop_reason"]) for f in finals] == [("stop", stop)]


def test_stop_reason_of_a_stop_token_is_its_id(server):
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    free = http(server, "POST", "/generate", json={"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}).json()
    token = free["token_ids"][4]
    first = free["token_ids"].index(token)
    out = http(server, "POST", "/v1/completions", json={**body, "stop_token_ids": [token]}).json()["choices"][0]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", token)
    assert out["text"] == http(server, "POST", "/detokenize", json={"tokens": free["token_ids"][:first]}).json()["prompt"]


def test_continuous_usage_stats_put_each_choice_s_usage_on_its_chunks(client):
    stream = list(client.completions.create(
        model="tiny", prompt=PROMPT, stream=True, n=2, max_tokens=6, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    *chunks, last = stream
    assert last.choices == [] and last.usage.completion_tokens == 12
    seen = {0: 0, 1: 0}
    for c in chunks:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == last.usage.prompt_tokens
        assert c.usage.completion_tokens >= seen[choice.index]
        seen[choice.index] = c.usage.completion_tokens
    assert seen == {0: 6, 1: 6}


def test_stream_options_need_a_stream(server):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        reply = http(server, "POST", path, json={"model": "tiny", "max_tokens": 2, **body,
                                                 "stream_options": {"include_usage": True}})
        assert_error(reply, 400, "stream_options")


def test_a_body_that_is_not_json_and_no_tokens_to_detokenize(server):
    bad = http(server, "POST", "/v1/completions", content=b'{"model": "tiny", "prompt": ',
               headers={"Content-Type": "application/json"})
    assert_error(bad, 400, "body")
    empty = http(server, "POST", "/detokenize", json={"tokens": []})
    assert empty.status_code == 200 and empty.json() == {"prompt": ""}


def test_a_busy_zeromq_port_fails_serve_at_once(folder):
    """The ZeroMQ port is bound once the model is loaded: another server on it answered serve's
    readiness probe ("serving ..."), then the bind failed and the gateway hung for good."""
    import socket
    import subprocess
    import sys

    from tests.served import engine_flags, free_ports
    port, zmq_port = free_ports(2)
    with socket.socket() as other:
        other.bind(("127.0.0.1", zmq_port))
        other.listen()
        out = subprocess.run([sys.executable, "-m", "stemma", "serve", "--model", folder, "--port", str(port),
                              "--zmq-port", str(zmq_port), *engine_flags()],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"cannot listen on the ZeroMQ port at 127.0.0.1:{zmq_port}: Address already in use" in out.stderr



def test_serve_on_the_ipv6_loopback(folder):
    """--host ::1: both ports listen there (the ZeroMQ sockets had no IPv6 option: the bind failed
    once the model loaded, and serve hung with nothing listening)."""
    import signal
    import socket
    import subprocess
    import sys

    from tests.served import engine_flags, free_ports
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port, zmq_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "stemma", "serve", "--model", folder, "--host", "::1",
                             "--port", str(port), "--zmq-port", str(zmq_port), *engine_flags()])
    try:
        zmq_client = stemma.connect(f"tcp://[::1]:{zmq_port}")
        deadline = time.monotonic() + 120
        while not zmq_client.health(timeout=1):
            assert proc.poll() is None and time.monotonic() < deadline, "serve on ::1 did not come up"
        ids = zmq_client.generate([5, 6, 7], GREEDY_3).token_ids
        assert stemma.connect(f"http://[::1]:{port}").generate([5, 6, 7], GREEDY_3).token_ids == ids
        zmq_client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


GREEDY_3 = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
