"""The HTTP client (`stemma.connect("http://...")`) against a real `stemma serve` on a tiny random
llama, side by side with the ZeroMQ client of the same server: the same outputs, streams,
errors and aborts, and frontend programs that run unchanged over it."""
import asyncio
import threading
import time

import pytest

import stemma
from stemma.client.core import CONNECTION_LOST, RequestTimeout
from stemma.client.http import HttpClient, HttpStream
from stemma.client.sync import Client
from stemma.lang.backends.remote import RemoteBackend
from tests.served import HttpServed, free_port
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

KEY = "s3cret"
FRAME_LIMIT = 64 * 1024
ENGINE = dict(dtype="float32", attention_backend="torch", kv_pool_tokens=8192, max_running_requests=32)
GREEDY = dict(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LONG = dict(temperature=0.0, max_new_tokens=2000, ignore_eos=True)  # would run for seconds
W = words()
FIELDS = ("text", "token_ids", "finish_reason", "logprobs", "top_logprobs", "prompt_logprobs")


class Served(HttpServed):
    """HttpServed with a client of each front: `http` (HttpClient) and `zmq`."""

    def __init__(self, folder: str, *extra: str, api_key: str | None = None):
        super().__init__(folder, *extra, *(("--api-key", api_key) if api_key else ()))
        self.http_port = self.port
        self.api_key = api_key
        # a reply that never comes fails the test (after 60 s without a message) instead of hanging CI
        self.http = HttpClient(self.url, api_key=api_key, timeout=60)
        self.zmq = stemma.connect(self.address, api_key=api_key, timeout=60)

    def stop(self) -> int:
        self.http.close()
        self.zmq.close()
        return super().stop()


def wait_idle(client, seconds: float = 15.0) -> dict:
    """The server's stats once nothing runs there (fails after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = client.info()["stats"]
        if stats["running"] == 0 and stats.get("queue", 0) == 0:
            return stats
        assert time.monotonic() < deadline, f"requests still running: {stats}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("http_client"))))


@pytest.fixture(scope="module")
def server(folder):
    # the fronts are compared chunk by chunk: speculation (tested on its own) would make a
    # request's chunks depend on what an earlier request left in the radix tree
    served = Served(folder, "--max-frame-bytes", str(FRAME_LIMIT), "--speculative", "none", api_key=KEY)
    yield served
    assert served.stop() == 0


class Near(float):
    """A logprob that equals another within 1e-4: two runs of one request may sit in different
    batches (speculation verifies drafts in wider forwards), which moves fp32 sums by up to ~2e-5."""

    def __eq__(self, other):
        return isinstance(other, float) and abs(float(self) - other) <= 1e-4

    __hash__ = float.__hash__


def _near(value):
    if isinstance(value, float):
        return Near(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_near(v) for v in value)
    return value


def fields(out):
    return {name: _near(getattr(out, name)) for name in FIELDS}


def prompts():
    text = [" ".join(W[(7 * i + j) % len(W)] for j in range(3 + 5 * i)) for i in range(3)]
    ids = [[(13 * i + 5 * j) % 92 + 4 for j in range(2 + 9 * i)] for i in range(3)]
    return text + ids


def test_connect_picks_the_transport(server):
    with stemma.connect(server.url, api_key=KEY) as client:
        assert isinstance(client, HttpClient) and client.address == server.url
        assert client.health() and client.info()["model"] == server.zmq.info()["model"]
    assert isinstance(stemma.connect(server.address), Client)
    assert isinstance(stemma.connect("https://example.invalid:1"), HttpClient)


def test_generate_matches_zmq(server):
    for prompt in prompts():
        for params in (GREEDY, dict(GREEDY, stop=[W[5]], ignore_eos=False),
                       dict(GREEDY, logprobs=True, top_logprobs=3, logprob_start=1)):
            if params.get("logprob_start") and isinstance(prompt, str) and len(prompt.split()) < 2:
                continue
            http, zmq = server.http.generate(prompt, params), server.zmq.generate(prompt, params)
            assert fields(http) == fields(zmq)
            assert http.meta["prompt_tokens"] == zmq.meta["prompt_tokens"]
    out = server.http.generate([5, 6, 7], dict(GREEDY, logprobs=True, top_logprobs=2), rid="mine-1")
    assert out.rid == "mine-1" and len(out.logprobs) == len(out.top_logprobs) == 12
    assert all(isinstance(pair, tuple) and isinstance(pair[0], int) for pos in out.top_logprobs for pair in pos)


def test_n_siblings(server):
    params = dict(GREEDY, n=2, temperature=1.0, seed=7)
    http = server.http.generate([5, 6, 7], params, rid="pair")
    zmq = server.zmq.generate([5, 6, 7], params, rid="pair-z")
    assert [o.rid for o in http] == ["pair-0", "pair-1"]
    assert [fields(o) for o in http] == [fields(o) for o in zmq]
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        server.http.stream([5, 6], params)


def test_stream_matches_zmq(server):
    for prompt in prompts()[:4]:
        with server.http.stream(prompt, GREEDY) as http:
            deltas = list(http)
        assert isinstance(http, HttpStream)
        zmq = server.zmq.stream(prompt, GREEDY)
        assert deltas == list(zmq) and len(deltas) > 1
        assert "".join(deltas) == http.output.text and http.token_ids == http.output.token_ids
        assert fields(http.output) == fields(zmq.output)
        assert http.output.rid == http.rid


def test_async_calls_match_zmq(server):
    async def both(prompt):
        out = await server.http.agenerate(prompt, GREEDY)
        stream = server.http.astream(prompt, GREEDY)
        deltas = [d async for d in stream]
        return out, deltas, stream.output

    async def main():
        return await asyncio.gather(*(both(p) for p in prompts())), await server.http.ainfo(), \
            await server.http.ahealth(), await server.http.aflush_cache()

    results, info, healthy, _ = asyncio.run(main())
    for prompt, (out, deltas, streamed) in zip(prompts(), results):
        zmq = server.zmq.generate(prompt, GREEDY)
        assert fields(out) == fields(zmq) == fields(streamed) and "".join(deltas) == zmq.text
    assert healthy and info["model"] == server.zmq.info()["model"]
    again = asyncio.run(server.http.agenerate(prompts()[0], GREEDY))  # another loop, another pool
    assert fields(again) == fields(results[0][0])


def test_info_health_flush(server):
    http, zmq = server.http.info(), server.zmq.info()
    assert {k: http[k] for k in ("model", "context_length", "vocab_size")} == \
        {k: zmq[k] for k in ("model", "context_length", "vocab_size")}
    assert set(http["stats"]) == set(zmq["stats"])
    assert server.http.health() is True
    wait_idle(server.http)
    assert server.http.flush_cache() is True


def test_errors_map_to_server_errors(server):
    with pytest.raises(stemma.ServerError) as http_err:
        server.http.generate([5, 999], GREEDY)
    with pytest.raises(stemma.ServerError) as zmq_err:
        server.zmq.generate([5, 999], GREEDY)
    assert http_err.value.code == zmq_err.value.code == "bad_request"
    with pytest.raises(stemma.ServerError) as err:  # the engine's refusal names its field over HTTP
        server.http.generate([5], {**GREEDY, "logit_bias": {999: 1.0}})
    assert err.value.param == "logit_bias", err.value
    with pytest.raises(stemma.ServerError) as err:  # not over ZeroMQ: a version-4 client reads it too
        server.zmq.generate([5], {**GREEDY, "logit_bias": {999: 1.0}})
    assert err.value.code == "bad_request" and err.value.param is None, err.value
    with pytest.raises(stemma.ServerError) as err:
        list(server.http.stream([5, 999], GREEDY))
    assert err.value.code == "bad_request"
    big = [5] * (FRAME_LIMIT // 2)  # "5, " per id: over the limit
    with pytest.raises(stemma.ServerError) as err:
        server.http.generate(big, GREEDY)
    assert err.value.code == "too_large"
    with pytest.raises(ValueError, match="max_new_tokens"):
        server.http.generate([5], {"max_new_tokens": -1})

    wrong = stemma.connect(server.url, api_key="wrong")
    for call in (lambda: wrong.generate([5], GREEDY), lambda: next(wrong.stream([5], GREEDY)),
                 wrong.info, wrong.flush_cache):
        with pytest.raises(stemma.ServerError) as err:
            call()
        assert err.value.code == "unauthorized"
    with pytest.raises(stemma.ServerError, match="unauthorized"):
        asyncio.run(wrong.agenerate([5], GREEDY))
    wrong.close()

    dead = stemma.connect(f"http://127.0.0.1:{free_port()}")
    assert dead.health() is False and asyncio.run(dead.ahealth()) is False
    with pytest.raises(stemma.ServerError) as err:
        dead.generate([5], GREEDY)
    assert err.value.code == CONNECTION_LOST
    with pytest.raises(stemma.ServerError) as err:
        next(dead.stream([5], GREEDY))
    assert err.value.code == CONNECTION_LOST


def generated(client) -> int:
    return client.info()["stats"]["generated_tokens"]


def test_streams_left_early_are_aborted(server):
    """Each of these would generate 2000 tokens (seconds) if its request were not aborted."""
    def check(leave, streams: int = 1):
        wait_idle(server.http)
        before = generated(server.http)
        leave()
        wait_idle(server.http)
        assert generated(server.http) - before < 1000 * streams

    def closed():
        stream = server.http.stream([5, 6, 7], LONG)
        assert next(stream) and next(stream)
        stream.close()
        assert stream.output is None

    def dropped():
        stream = server.http.stream([5, 6, 8], LONG)
        next(stream)
        del stream  # a dropped stream closes its connection too

    def aborted():
        stream = server.http.stream([5, 6, 9], LONG)
        first = next(stream)
        server.http.abort(stream.rid)
        assert list(stream) == []
        assert stream.output.finish_reason == "abort" and stream.output.text == first

    def timed_out():
        with pytest.raises(RequestTimeout):
            server.http.generate([5, 6, 6], LONG, timeout=0.2)

    async def async_ones():
        stream = server.http.astream([5, 7, 7], LONG)
        async for _ in stream:
            break
        await stream.aclose()

        async def read(stream):
            return [d async for d in stream]

        stream = server.http.astream([5, 7, 8], LONG)
        task = asyncio.create_task(read(stream))
        while not stream.token_ids:
            await asyncio.sleep(0.02)
        await server.http.aabort(stream.rid)
        deltas = await task
        assert stream.output.finish_reason == "abort" and "".join(deltas) == stream.output.text

        stream = server.http.astream([5, 7, 9], LONG)
        task = asyncio.create_task(read(stream))
        while not stream.token_ids:
            await asyncio.sleep(0.02)
        task.cancel()  # a cancelled task leaves its stream, which closes
        with pytest.raises(asyncio.CancelledError):
            await task
        task = asyncio.create_task(server.http.agenerate([5, 8, 9], LONG))
        await asyncio.sleep(0.3)
        task.cancel()  # a cancelled call closes its connection
        with pytest.raises(asyncio.CancelledError):
            await task

    for leave in (closed, dropped, aborted, timed_out):
        check(leave)
    check(lambda: asyncio.run(async_ones()), streams=4)


@stemma.function
def program(s, topic):
    s += " ".join(W[:30]) + " " + topic
    s += stemma.gen("first", max_new_tokens=8, stop=W[9])
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += " " + W[i + 20] + stemma.gen("idea", max_new_tokens=5)
    forks.join()
    s += " " + W[4] + stemma.select("pick", [W[1], W[2] + " " + W[3]])
    s += " " + stemma.select("again", [W[6], W[7] + " " + W[8], W[9]], method="greedy_token")


def test_programs_run_unchanged_over_http(server):
    sampling = {"temperature": 0}
    wait_idle(server.http)
    assert server.zmq.flush_cache()  # both runs start from an empty cache
    zmq = program.run(topic=W[60], backend=RemoteBackend(server.zmq), sampling=sampling)
    assert server.http.flush_cache()
    http = program.run(topic=W[60], backend=RemoteBackend(server.http), sampling=sampling)
    direct = program.run(topic=W[60], backend=server.http, sampling=sampling)  # as_backend
    streamed = program.run(topic=W[60], backend=RemoteBackend(server.http), sampling=sampling, stream=True)
    deltas = list(streamed.text_iter())
    for state in (http, direct, streamed):
        assert state.vars() == zmq.vars() and state.text() == zmq.text()
        assert state.meta("pick").scores == pytest.approx(zmq.meta("pick").scores, abs=1e-5)
    assert "".join(deltas) == zmq.text()
    assert [c.cached_tokens for c in http.calls()] == [c.cached_tokens for c in zmq.calls()]
    by_address = RemoteBackend(stemma.connect(server.url, api_key=KEY))
    assert program.run(topic=W[61], backend=by_address, sampling=sampling).vars() == \
        program.run(topic=W[61], backend=RemoteBackend(server.zmq), sampling=sampling).vars()
    by_address.close()
    wait_idle(server.http)


def test_unreachable_http_server_is_named():
    port = free_port()
    backend = RemoteBackend(f"http://127.0.0.1:{port}", connect_timeout=1.0)
    assert isinstance(backend.client, HttpClient)
    with pytest.raises(stemma.BackendUnreachable, match=rf"server at http://127.0.0.1:{port} is unreachable"):
        program.run(topic="x", backend=backend)
    backend.close()


def test_an_async_stream_aborted_before_its_headers_ends_as_aborted():
    """The server sends a stream's headers with the engine's first reply: aborting (or closing)
    a stream still queued cancelled the send under its reader, and the caller got a
    CancelledError instead of the stream's end (the ZeroMQ client ends it as aborted)."""
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()  # never answers

    async def main():
        client = HttpClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=10)
        stream = client.astream("hi", {"max_new_tokens": 4}, rid="r1")

        async def consume():
            return [delta async for delta in stream]

        reading = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        await client.aabort("r1")
        return await asyncio.wait_for(reading, 5), stream.output

    deltas, output = asyncio.run(main())
    assert deltas == [] and output.finish_reason == "abort"
    listener.close()
