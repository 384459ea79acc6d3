"""`stemma serve` end to end, on a tiny random llama with a tiny word-level tokenizer.

The server runs as a real subprocess (`python -m stemma serve`); its outputs are compared with the
in-process Engine on the same checkpoint.
"""
import asyncio
import os
import signal
import sys
import time

import msgpack
import pytest
import zmq

import stemma
from stemma import protocol as P
from stemma.sampling_params import SamplingParams
from stemma.serve.prompt_jobs import INLINE_CHARS
from tests.served import ENGINE, HttpServed, alive, children, cmdline
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

KEY = "s3cret"
FRAME_LIMIT = 64 * 1024
GREEDY = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True)
LONG = dict(temperature=0.0, max_new_tokens=2000, ignore_eos=True)  # would run for seconds
DOOMED_CLIENT = f"""
import sys, time, stemma
client = stemma.connect(sys.argv[1], api_key=sys.argv[2])
assert client.health(timeout=30)
print("ready", flush=True)
sys.stdin.readline()
stream = client.stream([int(t) for t in sys.argv[3].split(",")], {LONG!r})
next(iter(stream))
print("streaming", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("serve_llama"))
    return str(save_tiny_tokenizer(path))


class Served(HttpServed):
    """HttpServed with a ZeroMQ client (`client`); its gateway and the gateway's engine are known
    (`children`, `child`)."""

    def __init__(self, folder, *extra):
        super().__init__(folder, *extra)
        self.client = stemma.connect(self.address, api_key=KEY if "--api-key" in extra else None)
        assert self.client.health(timeout=30)
        (gateway,) = [p for p in self.children if "stemma.serve.gateway" in cmdline(p)]
        self.children = [gateway, *children(gateway)]  # the engine is the gateway's child
        assert len(self.children) == 2

    def child(self, module: str) -> int:
        (pid,) = [p for p in self.children if module in cmdline(p)]
        return pid

    def stop(self) -> int:
        self.client.close()
        return super().stop()


@pytest.fixture(scope="module")
def server(folder):
    served = Served(folder, "--api-key", KEY, "--max-frame-bytes", str(FRAME_LIMIT))
    yield served
    waiting = stemma.connect(served.address, api_key=KEY).stream([5, 6], LONG, timeout=30)
    next(iter(waiting))
    assert served.stop() == 0  # SIGINT is a clean shutdown, and a waiting client hears why
    with pytest.raises(stemma.ServerError, match="shutting_down"):
        list(waiting)
    time.sleep(0.2)
    assert not any(alive(pid) for pid in served.children)


def make_prompts():
    vocab = words()
    text = [" ".join(vocab[(7 * i + j) % len(vocab)] for j in range(3 + 5 * i % 17)) for i in range(16)]
    shared = [(11 * j) % 92 + 4 for j in range(24)]
    ids = [(shared if i % 2 else []) + [(13 * i + 5 * j) % 92 + 4 for j in range(2 + 7 * i % 29)]
           for i in range(16)]
    params = [dict(GREEDY, stop=[vocab[5]] if i % 5 == 0 else None) for i in range(32)]
    return text + ids, params


@pytest.fixture(scope="module")
def engine(folder):
    return stemma.Engine(folder, **ENGINE)


@pytest.fixture(scope="module")
def reference(engine):
    """The in-process Engine's token ids and streamed text for each prompt."""
    prompts, params = make_prompts()
    out = []
    for prompt, p in zip(prompts, params):
        text = "".join(engine.stream(prompt, p))
        out.append((engine.generate(prompt, p).token_ids, text))
    assert len({tuple(ids) for ids, _ in out}) > 20
    return out


async def wait_idle(client, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = (await client.ainfo())["stats"]
        if stats["running"] == 0 and stats["queue"] == 0:
            return stats
        assert time.monotonic() < deadline, f"requests still running: {stats}"
        await asyncio.sleep(0.05)


async def stream_all(client, prompt, params):
    stream = client.astream(prompt, params, timeout=60)
    deltas = [d async for d in stream]
    return stream, deltas


async def abort_midway(client, prompt):
    stream = client.astream(prompt, LONG, timeout=60)
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            await client.aabort(stream.rid)
    return stream


async def start_doomed_clients(address, prompts):
    """Client processes, each streaming a long request, to be killed."""
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", DOOMED_CLIENT, address, KEY, ",".join(map(str, p)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for p in prompts]
    for proc in procs:
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"ready\n"
    for proc in procs:  # all start streaming at once
        proc.stdin.write(b"go\n")
    for proc in procs:
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"streaming\n"
    return procs


def test_concurrent_streams_match_the_engine(server, reference):
    prompts, params = make_prompts()
    doomed_prompts = [[40 + i, 9, 17] for i in range(8)]
    abort_prompts = [[50 + i, 3, 8, 21] for i in range(8)]

    async def main():
        clients = [stemma.connect(server.address, api_key=KEY) for _ in range(48)]
        before = (await clients[0].ainfo())["stats"]
        doomed = await start_doomed_clients(server.address, doomed_prompts)
        streams = [asyncio.ensure_future(stream_all(c, p, sp)) for c, p, sp in zip(clients, prompts, params)]
        aborts = [asyncio.ensure_future(abort_midway(c, p)) for c, p in zip(clients[32:40], abort_prompts)]
        await asyncio.sleep(0.05)
        for proc in doomed:  # disconnect abruptly, mid-stream, all at once (reaped after)
            proc.kill()
        await asyncio.gather(*(proc.wait() for proc in doomed))
        results = await asyncio.gather(*streams)
        aborted = await asyncio.gather(*aborts)
        stats = await wait_idle(clients[0])
        return before, results, aborted, stats, clients

    before, results, aborted, stats, clients = asyncio.run(main())
    for (stream, deltas), (ids, text), prompt in zip(results, reference, prompts):
        assert stream.output.token_ids == ids, prompt
        assert "".join(deltas) == text == stream.output.text
        assert stream.token_ids == ids
    assert {s.output.finish_reason for s, _ in results} == {"length", "stop"}  # stop strings were hit
    for stream in aborted:
        assert stream.output.finish_reason == "abort"
        assert 3 <= len(stream.output.token_ids) < LONG["max_new_tokens"]
    assert stats["pool_whole"] and stats["running"] == 0 and stats["queue"] == 0
    # The killed clients' requests were aborted, not run to their full length.
    finished = sum(len(s.output.token_ids) for s, _ in results) + sum(len(s.output.token_ids) for s in aborted)
    by_doomed = stats["generated_tokens"] - before["generated_tokens"] - finished
    assert by_doomed < 8 * LONG["max_new_tokens"] // 4
    assert server.client.flush_cache()
    stats = server.client.info()["stats"]
    assert stats["pool_free"] == stats["pool_total"] and stats["pool_whole"]
    for c in clients:
        c.close()


@pytest.fixture
def raw(server):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    yield sock
    sock.close()


def exchange(sock, body, key=KEY):
    sock.send_multipart([key.encode(), body])
    assert sock.poll(10_000), "no reply"
    return P.decode(sock.recv_multipart()[-1])


def wire(**fields):
    return msgpack.packb({"version": P.PROTOCOL_VERSION, **fields})


BAD_INPUTS = {
    "garbage": (b"\xc1\xc1\x00 garbage", P.BAD_REQUEST, "", "msgpack"),
    "truncated": (P.encode(P.GenerateReq(rid="t", input_ids=[5, 6]))[:-2], P.BAD_REQUEST, "", "msgpack"),
    "unknown_type": (wire(type="detonate", rid="u"), P.BAD_REQUEST, "u", "unknown message type"),
    "reply_type": (P.encode(P.HealthOk(rid="r")), P.BAD_REQUEST, "r", "not accepted"),
    "wrong_field_type": (wire(type="generate", rid="w", input_ids="5 6"), P.BAD_REQUEST, "w",
                         "input_ids must be list[int]"),
    "negative_max_new_tokens": (wire(type="generate", rid="n", input_ids=[5], params={"max_new_tokens": -3}),
                                P.BAD_REQUEST, "n", "max_new_tokens must be >= 0"),
    "prompt_over_context": (P.encode(P.GenerateReq(rid="c", input_ids=[5] * 3000)), P.BAD_REQUEST, "c",
                            "does not fit the context"),
    "text_over_context": (P.encode(P.GenerateReq(rid="x", prompt="ka " * 3000)), P.BAD_REQUEST, "x",
                          "does not fit the context"),
    "invalid_token_id": (P.encode(P.GenerateReq(rid="i", input_ids=[5, 96])), P.BAD_REQUEST, "i",
                         "outside [0, 96)"),
    "over_size_limit": (P.encode(P.GenerateReq(rid="big", prompt="ka " * (FRAME_LIMIT // 3 + 10))), P.TOO_LARGE,
                        "big", "over the limit"),  # its id read without decoding the rest
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_gets_an_error_and_the_server_stays_up(server, raw, name):
    body, code, rid, words_ = BAD_INPUTS[name]
    reply = exchange(raw, body)
    assert isinstance(reply, P.ErrorMsg) and reply.code == code and reply.rid == rid, reply
    assert words_ in reply.message
    ok = exchange(raw, P.encode(P.GenerateReq(rid="ok", input_ids=[5, 6], params=SamplingParams(**GREEDY))))
    assert isinstance(ok, P.Finished) and len(ok.token_ids) == GREEDY["max_new_tokens"]


def long_text(engine):
    """A text prompt over prompt_jobs.INLINE_CHARS that fits the tiny model's context."""
    vocab = [w for w in words() if len(w) >= 4]
    text = " ".join(vocab[(5 * i) % len(vocab)] for i in range(1700))
    assert len(text) > INLINE_CHARS and len(engine.tokenizer(text).input_ids) < 1900
    return text


def replies(sock, count):
    out = []
    while len(out) < count:
        assert sock.poll(30_000), f"no reply after {out}"
        out.append(P.decode(sock.recv_multipart()[-1]))
    return out


def test_a_long_text_prompt_is_tokenized_off_the_loop(server, raw, engine):
    """Text prompts over INLINE_CHARS are tokenized on the gateway's worker thread: the same
    output as the engine's; an Abort right behind the request ends it; a second request under
    the same id while the first is tokenized is refused."""
    text = long_text(engine)
    done = exchange(raw, P.encode(P.GenerateReq(rid="long", prompt=text, params=SamplingParams(**GREEDY))))
    assert isinstance(done, P.Finished) and done.token_ids == engine.generate(text, GREEDY).token_ids
    raw.send_multipart([KEY.encode(), P.encode(P.GenerateReq(rid="gone", prompt=text, params=SamplingParams(**LONG)))])
    raw.send_multipart([KEY.encode(), P.encode(P.Abort(rid="gone"))])
    (aborted,) = replies(raw, 1)
    assert isinstance(aborted, P.Finished) and aborted.finish_reason == "abort", aborted
    twice = P.encode(P.GenerateReq(rid="twice", prompt=text, params=SamplingParams(**GREEDY)))
    raw.send_multipart([KEY.encode(), twice])
    raw.send_multipart([KEY.encode(), twice])
    got = replies(raw, 2)
    assert sorted(type(m).__name__ for m in got) == ["ErrorMsg", "Finished"], got
    refused = next(m for m in got if isinstance(m, P.ErrorMsg))
    assert refused.rid == "twice" and "already in flight" in refused.message


def test_wrong_api_key_and_bad_envelope(server, raw):
    good = P.encode(P.GenerateReq(rid="k", input_ids=[5, 6], params=SamplingParams(**GREEDY)))
    for key in ("wrong", ""):
        reply = exchange(raw, good, key=key)
        assert isinstance(reply, P.ErrorMsg) and reply.code == P.UNAUTHORIZED
    raw.send(good)  # one frame: no key frame at all
    assert raw.poll(10_000)
    reply = P.decode(raw.recv_multipart()[-1])
    assert reply.code in (P.BAD_REQUEST, P.UNAUTHORIZED)
    with pytest.raises(stemma.ServerError, match="unauthorized"):
        stemma.connect(server.address, api_key="nope").generate([5, 6], GREEDY, timeout=10)
    assert isinstance(exchange(raw, good), P.Finished)


def test_killing_the_engine_with_no_restart_fails_waiting_clients_and_serve(folder):
    served = Served(folder, "--no-restart")
    try:
        stream = served.client.stream([5, 6, 7], LONG, timeout=30)
        next(iter(stream))
        os.kill(served.child("stemma.engine.process"), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(stemma.ServerError) as info:
            for _ in stream:
                pass
        assert time.monotonic() - start < 5
        assert info.value.code in (P.ENGINE_DEAD, "connection_lost")
        if info.value.code == P.ENGINE_DEAD:
            assert "killed by signal 9 (SIGKILL)" in str(info.value)
            assert "not restarting it (--no-restart)" in str(info.value)
        assert served.proc.wait(20) != 0
    finally:
        served.stop()
    assert not any(alive(pid) for pid in served.children)


def test_runtime_starts_serves_cancels_and_stops(folder, engine, reference):
    prompts, params = make_prompts()
    def server_children():  # other tests' embedded runtimes may live in this process too
        return {p for p in children(os.getpid()) if "stemma.serve.gateway" in cmdline(p)}

    before = server_children()
    with stemma.Runtime(folder, **ENGINE) as rt:
        assert rt.address.startswith("ipc://") and rt.running
        (gateway,) = server_children() - before
        pids = [gateway, *children(gateway)]  # the gateway runs the engine
        assert len(pids) == 2 and "stemma.engine.process" in cmdline(pids[1])
        assert rt.client.generate(prompts[3], params[3]).token_ids == reference[3][0]
        scored = dict(GREEDY, logprobs=True, top_logprobs=2, logprob_start=0)
        served, local = rt.client.generate([5, 6, 7], scored), engine.generate([5, 6, 7], scored)
        assert served.token_ids == local.token_ids and served.top_logprobs[0][0][0] == local.token_ids[0]
        for a, b in ((served.logprobs, local.logprobs), (served.prompt_logprobs[1:], local.prompt_logprobs[1:])):
            assert a == pytest.approx(b, abs=1e-4)
        sampled = dict(temperature=1.0, seed=3, n=2, max_new_tokens=8)  # n > 1: one output per sequence
        outs = rt.client.generate("ka lo mi", sampled, rid="pair")
        assert [o.rid for o in outs] == ["pair-0", "pair-1"]
        assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate("ka lo mi", sampled)]
        info = rt.client.info()["stats"]
        assert info["gc_settles"] >= 1 and info["gc_frozen_objects"] > 0  # the engine froze its startup heap
        before = info["generated_tokens"]
        stream = rt.client.stream([7, 8, 9], LONG)
        next(iter(stream))
        stream.close()  # the sync client cancels

        async def cancel():
            task = asyncio.ensure_future(rt.client.agenerate([7, 8, 10], LONG))
            while (await rt.client.ainfo())["stats"]["running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()  # the async client cancels
            with pytest.raises(asyncio.CancelledError):
                await task
            return await wait_idle(rt.client, timeout=5)

        stats = asyncio.run(cancel())
        assert stats["pool_whole"]
        assert stats["generated_tokens"] - before < LONG["max_new_tokens"] // 2
    assert not rt.running
    assert not any(alive(pid) for pid in pids)


def test_the_text_of_eos_is_left_out_by_the_gateway(folder, engine, tmp_path):
    """The engine tells the gateway its EOS ids (EngineReady), so served text leaves out EOS's
    text as the in-process Engine does; include_stop_str_in_output keeps it."""
    import json
    import shutil
    prompt = [9, 30, 41, 12]
    full = engine.generate(prompt, SamplingParams(**GREEDY))
    eos = full.token_ids[2]
    assert eos not in full.token_ids[:2]
    two = engine.generate(prompt, SamplingParams(**{**GREEDY, "max_new_tokens": 2})).text
    three = engine.generate(prompt, SamplingParams(**{**GREEDY, "max_new_tokens": 3})).text
    assert two != three
    copy = shutil.copytree(folder, tmp_path / "eos")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    served = Served(str(copy))
    try:
        ending = dict(temperature=0.0, max_new_tokens=16)
        for params, text in ((ending, two), ({**ending, "include_stop_str_in_output": True}, three)):
            out = served.client.generate(prompt, params)
            assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:3]
            assert out.text == text == "".join(served.client.stream(prompt, params))
    finally:
        assert served.stop() == 0
