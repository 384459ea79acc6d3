"""OpenAIBackend: programs over an OpenAI-compatible API, here a real `stemma serve`'s /v1 routes
on a tiny random llama, compared with the native backend on the same server; and a small fake
server that returns no logprobs, for the error select gives there."""
import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import stemma
from stemma.lang.backends.openai import CharCodec, OpenAIBackend, OpenAIBackendError, messages_of
from stemma.lang.backends.remote import RemoteBackend
from stemma.sampling_params import SamplingParams
from tests.test_http_client import Served, free_port, wait_idle
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

KEY = "k3y"
W = words()
# greedy, and no special token mid-output: its id would be in the native program's ids but not
# in any text, which is all an OpenAI server returns (see OpenAIBackend's docstring)
GREEDY = {"temperature": 0, "logit_bias": {0: -100, 1: -100, 3: -100}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("openai_backend"))))


@pytest.fixture(scope="module")
def server(folder):
    served = Served(folder, "--served-model-name", "tiny", api_key=KEY)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def native(server):
    return RemoteBackend(server.zmq)


@pytest.fixture(scope="module", params=["text", "token ids"])
def backend(request, server, folder):
    """Without a tokenizer (text prompts) and with the model's (token-id prompts)."""
    tokenizer = folder if request.param == "token ids" else None
    backend = OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY, tokenizer=tokenizer)
    yield backend
    backend.close()


@stemma.function
def writer(s, topic):
    s += " ".join(W[:30]) + " " + topic
    s += stemma.gen("first", max_new_tokens=8)
    s += " " + W[3] + stemma.gen("second", max_new_tokens=10, stop=[W[7], W[8]])
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += " " + W[i + 20] + stemma.gen("idea", max_new_tokens=5)
    forks.join()


@stemma.function
def chooser(s, topic, unconditional=False):
    s += " ".join(W[10:40]) + " " + topic
    # the space before each select: without a tokenizer the server tokenizes prefix and choice
    # as one text, and a choice glued to the prefix's last word would merge with it
    s += " " + W[4] + " " + stemma.select("pick", [W[1], W[2] + " " + W[3], W[50]])
    s += stemma.gen("after", max_new_tokens=4)
    s += " " + stemma.select("greedy", [W[6], W[7] + " " + W[8], W[9]], method="greedy_token")
    if unconditional:
        s += " " + stemma.select("uncond", [W[11], W[12] + " " + W[13]],
                                 method="unconditional_likelihood_normalized")


@stemma.function
def chat(s):
    s += stemma.system(" ".join(W[:6]))
    s += stemma.user(" ".join(W[10:30]))
    s += stemma.assistant(stemma.gen("reply", max_new_tokens=10))
    s += stemma.user(" ".join(W[30:35]))
    s += stemma.assistant(stemma.gen("again", max_new_tokens=6))


def test_gen_matches_native(backend, native):
    for topic in (W[60], W[61] + " " + W[62]):
        here = writer.run(topic=topic, backend=backend, sampling=GREEDY)
        there = writer.run(topic=topic, backend=native, sampling=GREEDY)
        assert here.vars() == there.vars() and here.text() == there.text()
        assert here.meta("first").meta["prompt_tokens"] == there.meta("first").meta["prompt_tokens"]
        assert [c.kind for c in here.calls()] == [c.kind for c in there.calls()]
    assert asyncio.run(backend.stats())["generated_tokens"] > 0


def test_streaming_gen(backend, native):
    streamed = writer.run(topic=W[63], backend=backend, sampling=GREEDY, stream=True)
    deltas = list(streamed.text_iter(generated_only=True))
    there = writer.run(topic=W[63], backend=native, sampling=GREEDY)
    assert streamed.vars() == there.vars() and streamed.text() == there.text()
    # more pieces than gens: each arrived in parts (speculative steps deliver several tokens at once)
    assert len(deltas) > 2 and "".join(deltas) == there["first"] + there["second"]

    ids = backend.codec.encode(" ".join(W[5:25]))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=False, logprobs=True)
    got: list[str] = []
    out = asyncio.run(backend.generate(ids, params, got.append))
    plain = asyncio.run(backend.generate(ids, params))
    assert len(got) > 1 and "".join(got) == out.text == plain.text
    assert out.logprobs == pytest.approx(plain.logprobs, abs=1e-5) and len(plain.logprobs) == 12
    assert out.meta["completion_tokens"] == 12 and out.meta["prompt_tokens"] > 0


def test_gen_logprobs_match_native(server, folder):
    backend = OpenAIBackend(server.url, "tiny", api_key=KEY, tokenizer=folder)  # /v1 is added
    ids = [5, 6, 7, 8]
    params = SamplingParams(temperature=0, max_new_tokens=8, logprobs=True)
    out = asyncio.run(backend.generate(ids, params))
    there = server.zmq.generate(ids, params)
    assert out.text == there.text and out.token_ids == there.token_ids
    assert out.logprobs == pytest.approx(there.logprobs, abs=1e-5)
    backend.close()


def test_select_matches_native(backend, native):
    with_ids = not isinstance(backend.codec, CharCodec)
    for topic in (W[64], W[65]):
        here = chooser.run(topic=topic, unconditional=with_ids, backend=backend, sampling=GREEDY)
        there = chooser.run(topic=topic, unconditional=with_ids, backend=native, sampling=GREEDY)
        assert here.vars() == there.vars() and here.text() == there.text()
        for name in ("pick", "greedy", "uncond") if with_ids else ("pick", "greedy"):
            assert here.meta(name).scores == pytest.approx(there.meta(name).scores, abs=1e-4)


def test_chat_turns(server, native, folder):
    there = chat.run(backend=native, sampling=GREEDY)
    auto = OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY)  # turns go to the chat route
    here = chat.run(backend=auto, sampling=GREEDY)
    assert here.vars() == there.vars() and here.messages() == there.messages()
    assert here.text().startswith("<|im_start|>system\n")
    streamed = chat.run(backend=OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY, mode="chat"),
                        sampling=GREEDY, stream=True)
    assert "".join(streamed.text_iter()) == streamed.text() and streamed.vars() == there.vars()
    for kw in (dict(mode="completions"), dict(tokenizer=folder)):  # turns rendered here, as text
        rendered = chat.run(backend=OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY, **kw),
                            sampling=GREEDY)
        assert rendered.vars() == there.vars() and rendered.text() == there.text()

    @stemma.function
    def partial(s):
        s += stemma.user(" ".join(W[10:30]))
        s += stemma.assistant(W[3] + stemma.gen("reply", max_new_tokens=6))

    with pytest.raises(ValueError, match="cannot continue a partly written assistant turn"):
        partial.run(backend=auto, sampling=GREEDY)
    continued = OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY, dialect="stemma")
    assert partial.run(backend=continued, sampling=GREEDY).vars() == \
        partial.run(backend=native, sampling=GREEDY).vars()

    @stemma.function
    def picky(s):
        s += stemma.user(W[5] + " " + W[6])
        s += stemma.assistant(stemma.select("pick", [W[1], W[2]]))

    with pytest.raises(OpenAIBackendError, match="select needs the logprobs of the prompt's tokens"):
        picky.run(backend=auto)

    @stemma.function
    def loose(s):
        s += stemma.user(W[5]) + " " + W[6] + stemma.gen("x", max_new_tokens=2)

    with pytest.raises(ValueError, match="text outside a chat turn"):
        loose.run(backend=auto)


def test_messages_of():
    text = "<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\nok"
    assert messages_of(text) == ([{"role": "user", "content": "hi\nthere"}], "ok")
    assert messages_of("<|im_start|>user\nhi<|im_end|>\n") == ([{"role": "user", "content": "hi"}], None)
    with pytest.raises(ValueError, match="open user turn"):
        messages_of("<|im_start|>user\nhi")


def test_sampling_fields(server, folder):
    plain = OpenAIBackend("http://127.0.0.1:1/v1", "m")
    body = plain._sampling(SamplingParams(max_new_tokens=5, temperature=0.5, top_p=0.9, stop="x",
                                          seed=3, presence_penalty=0.5, logprobs=True,
                                          json_schema={"type": "object"}), chat=False)
    assert body == {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": ["x"], "seed": 3,
                    "presence_penalty": 0.5, "logprobs": 1,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "output", "schema": {"type": "object"}, "strict": True}}}
    for field, value in (("top_k", 5), ("min_p", 0.1), ("ignore_eos", True), ("regex", "a+"),
                         ("min_new_tokens", 2), ("stop_token_ids", [3])):
        with pytest.raises(ValueError, match=f"{field} is not a field of OpenAI's API"):
            plain._sampling(SamplingParams(**{field: value}), chat=False)
    with pytest.raises(ValueError, match="grammar"):
        plain._sampling(SamplingParams(grammar='start: "a"'), chat=False)
    vllm = OpenAIBackend("http://127.0.0.1:1/v1", "m", dialect="vllm")
    body = vllm._sampling(SamplingParams(top_k=5, min_new_tokens=2, regex="a+", top_logprobs=3), chat=True)
    assert body["top_k"] == 5 and body["min_tokens"] == 2 and body["logprobs"] is True
    assert body["structured_outputs"] == {"regex": "a+"}
    sglang = OpenAIBackend("http://127.0.0.1:1/v1", "m", dialect="sglang")
    assert sglang._sampling(SamplingParams(regex="a+"), chat=False)["regex"] == "a+"

    # the extras reach a server that takes them: top_k=1 samples greedily, stop_token_ids stop
    stemma_ = OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY, dialect="stemma")
    ids = [5, 6, 7]
    plain_text = dict(max_new_tokens=10, ignore_eos=True, logit_bias=GREEDY["logit_bias"])
    greedy = server.zmq.generate(ids, SamplingParams(temperature=0, **plain_text))
    params = SamplingParams(temperature=1.0, top_k=1, **plain_text)
    out = asyncio.run(OpenAIBackend(server.url + "/v1", "tiny", api_key=KEY, dialect="stemma",
                                    tokenizer=folder).generate(ids, params))
    assert out.token_ids == greedy.token_ids
    stop_at = greedy.token_ids[3]
    text = CharCodec().encode(" ".join(W[i - 4] for i in ids))
    out = asyncio.run(stemma_.generate(text, params.replace(stop_token_ids=[stop_at])))
    assert out.finish_reason == "stop" and out.meta["completion_tokens"] <= 4  # not 10


def test_model_is_read_from_the_server(server):
    backend = OpenAIBackend(server.url + "/v1", api_key=KEY)
    out = asyncio.run(backend.generate(CharCodec().encode(W[5]), SamplingParams(max_new_tokens=2)))
    assert backend.model == "tiny" and 1 <= out.meta["completion_tokens"] <= 2
    wrong = OpenAIBackend(server.url + "/v1", "nope", api_key=KEY)
    with pytest.raises(OpenAIBackendError, match=r"refused /completions \(HTTP 404\).*nope"):
        asyncio.run(wrong.generate(CharCodec().encode(W[5]), SamplingParams(max_new_tokens=2)))
    unkeyed = OpenAIBackend(server.url + "/v1", "tiny")
    with pytest.raises(OpenAIBackendError, match="HTTP 401"):
        asyncio.run(unkeyed.generate(CharCodec().encode(W[5]), SamplingParams(max_new_tokens=2)))
    wait_idle(server.http)


# ---- a server without logprobs ----
def fake_app(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if body.get("max_tokens") == 0:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1",
                                           "type": "invalid_request_error"}}, status_code=400)
        prompt = body["prompt"] if isinstance(body["prompt"], str) else ""
        if body.get("stream"):  # one event, then the body ends without [DONE] (a cut stream)
            event = {"choices": [{"index": 0, "text": "partial", "finish_reason": None}]}
            return StreamingResponse(iter([f"data: {json.dumps(event)}\n\n"]), media_type="text/event-stream")
        text = prompt if body.get("echo") else ""
        return {"choices": [{"index": 0, "text": text + " fake reply", "logprobs": None,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 2,
                          "total_tokens": len(prompt.split()) + 2}}
    return app


@pytest.fixture(scope="module")
def fake():
    seen: list[dict] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(seen), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def test_a_server_without_prompt_logprobs(fake):
    url, seen = fake

    @stemma.function
    def both(s):
        s += "Question: yes or no?"
        s += stemma.gen("answer", max_new_tokens=2)
        s += " So: " + stemma.select("pick", ["yes", "no"])

    backend = OpenAIBackend(url)  # the model comes from /v1/models
    with pytest.raises(OpenAIBackendError,
                       match=r"server at .* returned no prompt logprobs for echo=True .*select needs them"):
        both.run(backend=backend)
    assert backend.model == "fake"
    gen = next(b for b in seen if b.get("max_tokens") == 2)
    assert gen["prompt"] == "Question: yes or no?" and gen["model"] == "fake"
    echoes = [b for b in seen if b.get("echo")]
    assert echoes and all(b["max_tokens"] == 1 and b["logprobs"] == 1 for b in echoes)  # 0 refused

    @stemma.function
    def only_gen(s):
        s += "Say something:" + stemma.gen("x", max_new_tokens=2)

    assert only_gen.run(backend=backend)["x"] == " fake reply"


def test_unreachable_server_is_named():
    port = free_port()
    backend = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "m")

    @stemma.function
    def one(s):
        s += "hi" + stemma.gen("x", max_new_tokens=2)

    with pytest.raises(stemma.BackendUnreachable,
                       match=rf"OpenAI-compatible server at http://127.0.0.1:{port}/v1 is unreachable"):
        one.run(backend=backend)
    with pytest.raises(ValueError, match="mode must be one of"):
        OpenAIBackend("http://x/v1", "m", mode="fast")
    with pytest.raises(ValueError, match="takes no tokenizer"):
        OpenAIBackend("http://x/v1", "m", mode="chat", tokenizer="/nowhere")


def test_a_stream_cut_short_is_an_error(fake):
    """An SSE body that ends without [DONE] (a server gone, a proxy cut) was a successful gen of
    partial text with no finish reason (the native HTTP client says connection lost)."""
    url, _ = fake
    backend = OpenAIBackend(url)
    with pytest.raises(OpenAIBackendError, match=r"ended before \[DONE\]"):
        asyncio.run(backend.generate([ord(c) for c in "hello"], SamplingParams(max_new_tokens=4),
                                     on_text=lambda text: None))
