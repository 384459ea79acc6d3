"""Clients never hang (issue 17), against real `stemma serve` subprocesses on a tiny random llama:
- a call to an address where no server answers fails within the connect timeout, naming it;
- a call whose server goes away (killed, gateway and engine included; or frozen, which only
  heartbeats can tell) fails within seconds, and later calls fail within the connect timeout;
- a client whose server came back on the same port works again;
- `generate` / `agenerate` take what Engine.generate takes: one prompt or a list, text or ids.
Sync and async, ZeroMQ and HTTP."""
import asyncio
import os
import signal
import socket
import threading
import time

import pytest
import zmq

import stemma
from stemma import protocol as P
from stemma.client.core import CONNECTION_LOST, DEFAULT_CONNECT_TIMEOUT_S, UNREACHABLE, Unreachable
from stemma.client.http import HttpClient
from stemma.client.sync import Client
from tests.served import HttpServed, alive, children, cmdline, free_port
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

LIMIT_S = 10.0  # the bound on any call against a server that is not there
GREEDY = dict(temperature=0.0, max_new_tokens=8, ignore_eos=True)
LONG = dict(temperature=0.0, max_new_tokens=2000, ignore_eos=True)  # runs for seconds
W = words()
TEXTS = [f"{W[3]} {W[8]} {W[1]}", f"{W[20]} {W[5]}", f"{W[11]} {W[11]} {W[30]} {W[2]}"]
IDS = [[5, 6, 7], [40, 41], [9, 80, 81, 82, 83]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("reliability"))))


@pytest.fixture(scope="module")
def server(folder):
    served = HttpServed(folder)
    yield served
    served.stop()


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    pids = [pid]
    for child in children(pid):
        pids.extend(tree(child))
    return pids


@pytest.fixture
def doomed(folder):
    """A server of its own, for a test that kills or freezes it; whatever is left is killed."""
    served = HttpServed(folder)
    pids = tree(served.proc.pid)
    yield served
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    served.proc.wait(10)


def signal_all(served: HttpServed, signum: int) -> float:
    """Sends `signum` to serve and every process under it (the gateway and the engine, whichever
    starts which); returns when. All are stopped first, so that none of them sees another die
    before its own signal (a gateway that saw serve die in between had failed its calls with
    shutting_down, as a server that stops in order does)."""
    pids = tree(served.proc.pid)
    commands = " | ".join(cmdline(pid) for pid in pids)
    assert "stemma.serve.gateway" in commands and "stemma.engine.process" in commands, commands
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    if signum != signal.SIGSTOP:
        for pid in pids:
            os.kill(pid, signum)
    return time.monotonic()


def fails_in_time(since: float, call, code: str, names: str) -> stemma.ServerError:
    """Runs `call`, which must raise a ServerError with `code`, naming `names`, within LIMIT_S of
    `since`."""
    with pytest.raises(stemma.ServerError) as info:
        call()
    took = time.monotonic() - since
    assert took < LIMIT_S, f"failed after {took:.1f} s, not within {LIMIT_S} s: {info.value}"
    assert info.value.code == code, info.value
    assert names in str(info.value), info.value
    return info.value


def read_all(stream) -> list[str]:
    return list(stream)


async def aread_all(stream) -> list[str]:
    return [delta async for delta in stream]


def silent_port() -> tuple[int, list[socket.socket]]:
    """A port that accepts no connection: a listener with a full backlog that never accepts, so
    connects hang as at a host that does not answer. Returns the port and the sockets to close."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    socks = [listener]
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        socks.append(filler)
    time.sleep(0.2)
    return port, socks


class FakeServer:
    """A ZeroMQ ROUTER at `address`, on its own context and thread, that answers Health with
    HealthOk and ignores the rest: enough to see a client connect, lose and regain its server."""

    def __init__(self, address: str):
        self.address = address
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        assert self._ready.wait(5), "the fake server did not bind"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        time.sleep(0.3)  # lets the client's socket see the connection close

    def _serve(self) -> None:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.address)
        self._ready.set()
        while not self._stop.is_set():
            if not router.poll(50):
                continue
            peer, *_, raw = router.recv_multipart()
            msg = P.decode(raw)
            if isinstance(msg, P.Health):
                router.send_multipart([peer, P.encode(P.HealthOk(rid=msg.rid))])
        router.close(0)
        ctx.term()


# ---- no server at the address ----
def test_zmq_calls_to_a_port_without_a_server_fail_within_the_connect_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"
    client = stemma.connect(address)  # the default connect timeout
    start = time.monotonic()
    error = fails_in_time(start, lambda: client.generate("Hi"), UNREACHABLE, address)
    assert isinstance(error, Unreachable)
    assert time.monotonic() - start >= DEFAULT_CONNECT_TIMEOUT_S - 0.1  # it waited, as configured
    assert "connect timeout of 5 s" in str(error)
    quick = stemma.connect(address, connect_timeout=1.0)
    start = time.monotonic()
    fails_in_time(start, lambda: read_all(quick.stream("Hi", GREEDY)), UNREACHABLE, address)
    assert time.monotonic() - start < 3.0  # configured: 1 s
    assert quick.health() is False  # health says "not serving" rather than raising
    for c in (client, quick):
        c.close()


def test_async_zmq_calls_to_a_port_without_a_server_fail_within_the_connect_timeout():
    address = f"tcp://127.0.0.1:{free_port()}"
    client = stemma.connect(address)

    async def both():
        start = time.monotonic()
        results = await asyncio.gather(client.agenerate([5, 6]), aread_all(client.astream("Hi")),
                                       return_exceptions=True)
        return start, results

    start, results = asyncio.run(both())
    for result in results:
        assert isinstance(result, Unreachable), result
        assert address in str(result)
    assert time.monotonic() - start < LIMIT_S
    client.close()


def test_a_port_that_connects_but_never_greets_is_unreachable_too():
    """TCP connects (into the listener's backlog), but no ZeroMQ handshake ever completes: the
    connect timeout counts from the handshake, not from TCP. Over HTTP the connect never ends."""
    port, socks = silent_port()
    try:
        for address in (f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}"):
            client = stemma.connect(address, connect_timeout=1.0)
            fails_in_time(time.monotonic(), lambda: client.generate("Hi"), UNREACHABLE, address)
            client.close()
    finally:
        for sock in socks:
            sock.close()


def test_http_calls_to_a_port_without_a_server_fail_at_once():
    url = f"http://127.0.0.1:{free_port()}"
    client = stemma.connect(url)
    assert isinstance(client, HttpClient)
    start = time.monotonic()
    fails_in_time(start, lambda: client.generate("Hi"), CONNECTION_LOST, url)
    fails_in_time(start, lambda: read_all(client.stream("Hi")), CONNECTION_LOST, url)

    async def calls():
        for call in (lambda: client.agenerate(["a", "b"]), lambda: aread_all(client.astream("Hi"))):
            with pytest.raises(stemma.ServerError) as info:
                await call()
            assert info.value.code == CONNECTION_LOST and url in str(info.value)

    asyncio.run(calls())
    assert time.monotonic() - start < LIMIT_S
    client.close()


def test_a_client_works_again_once_its_server_is_back():
    """ZeroMQ reconnects by itself: calls while the server is away get the connect timeout, and
    calls after it came back on the same port succeed, sync and async."""
    address = f"tcp://127.0.0.1:{free_port()}"
    client = Client(address, connect_timeout=1.0)
    loop = asyncio.new_event_loop()  # one loop: its async socket lives through the test
    try:
        fails_in_time(time.monotonic(), lambda: client.info(timeout=30), UNREACHABLE, address)
        for _ in range(2):  # up, then away, twice
            with FakeServer(address):
                assert client.health(timeout=5)
                assert loop.run_until_complete(client.ahealth(timeout=5))
            fails_in_time(time.monotonic(), lambda: client.info(timeout=30), UNREACHABLE, address)
            fails_in_time(time.monotonic(), lambda: loop.run_until_complete(client.ainfo(timeout=30)),
                          UNREACHABLE, address)
    finally:
        client.close()
        loop.run_until_complete(asyncio.sleep(0))  # lets the closed client's reader task end
        loop.close()


# ---- a server that goes away mid-request ----
def all_in_flight_fail(served: HttpServed, signum: int, clients: dict[str, object],
                       loop: asyncio.AbstractEventLoop) -> float:
    """Puts a stream, an async stream, a generate (on a thread of its own) and an agenerate of
    each client in flight, then sends `signum` to every server process: each call must fail with
    CONNECTION_LOST, naming its address, within LIMIT_S. Returns when the signal was sent."""
    streams = {name: client.stream(IDS[0], LONG) for name, client in clients.items()}
    for stream in streams.values():
        next(stream)

    async def start_async():
        astreams = {name: client.astream(IDS[1], LONG) for name, client in clients.items()}
        for astream in astreams.values():
            await astream.__anext__()
        tasks = {name: asyncio.ensure_future(client.agenerate(IDS[2], LONG))
                 for name, client in clients.items()}
        await asyncio.sleep(0.3)  # their requests are out
        return astreams, tasks

    astreams, tasks = loop.run_until_complete(start_async())
    failed: dict[str, tuple[BaseException, float]] = {}

    def generate(name: str, client) -> None:
        try:
            client.generate(IDS[2], LONG)
        except BaseException as exc:  # checked below, in the test's thread
            failed[name] = (exc, time.monotonic())

    threads = [threading.Thread(target=generate, args=item, daemon=True) for item in clients.items()]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # their requests are out (and 2000 tokens take far longer)
    signalled = signal_all(served, signum)
    for thread in threads:
        thread.join(LIMIT_S + 5)
    for name, client in clients.items():
        exc, when = failed.get(name, (None, None))
        assert isinstance(exc, stemma.ServerError), f"{name} generate: {exc!r}"
        assert when - signalled < LIMIT_S, f"{name} generate failed after {when - signalled:.1f} s"
        assert exc.code == CONNECTION_LOST and client.address in str(exc), exc
        fails_in_time(signalled, lambda: read_all(streams[name]), CONNECTION_LOST, client.address)
        fails_in_time(signalled, lambda: loop.run_until_complete(aread_all(astreams[name])),
                      CONNECTION_LOST, client.address)
        fails_in_time(signalled, lambda: loop.run_until_complete(tasks[name]), CONNECTION_LOST,
                      client.address)
    return signalled


def test_calls_whose_server_is_killed_fail_within_seconds(doomed):
    """SIGKILL to serve, its gateway and its engine, mid-request: every call (ZeroMQ and HTTP,
    sync and async, streamed or not) fails within LIMIT_S, and new calls within the connect timeout."""
    clients = {"zmq": stemma.connect(doomed.address, connect_timeout=2.0),  # the default: see above
               "http": stemma.connect(doomed.url)}
    loop = asyncio.new_event_loop()
    try:
        all_in_flight_fail(doomed, signal.SIGKILL, clients, loop)
        time.sleep(0.3)  # the ZeroMQ sockets have seen the connection close
        zmq_client = clients["zmq"]
        fails_in_time(time.monotonic(), lambda: zmq_client.generate("Hi"), UNREACHABLE,
                      doomed.address)
        fails_in_time(time.monotonic(), lambda: loop.run_until_complete(zmq_client.agenerate("Hi")),
                      UNREACHABLE, doomed.address)
    finally:
        for client in clients.values():
            client.close()
        loop.run_until_complete(asyncio.sleep(0))  # lets the closed clients' tasks end
        loop.close()


def test_zmq_calls_whose_server_freezes_fail_by_heartbeat(doomed):
    """SIGSTOP to every server process: the connection stays open, so only ZeroMQ heartbeats can
    tell; every call, sync and async, streamed or not, fails within LIMIT_S. (Over HTTP only TCP
    keepalive watches the connection, and a frozen process's kernel still answers it.)"""
    client = stemma.connect(doomed.address)
    loop = asyncio.new_event_loop()
    try:
        all_in_flight_fail(doomed, signal.SIGSTOP, {"zmq": client}, loop)
    finally:
        client.close()
        loop.run_until_complete(asyncio.sleep(0))  # lets the closed client's reader task end
        loop.close()


# ---- what generate takes ----
def one_by_one(client, prompts, params):
    outs = []
    for prompt, p in zip(prompts, params):
        out = client.generate(prompt, p)
        outs.extend(out if isinstance(out, list) else [out])
    return outs


def same(outs, expected):
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == \
        [(o.text, o.token_ids, o.finish_reason) for o in expected]


@pytest.mark.parametrize("front", ["zmq", "http"])
def test_a_list_of_prompts_gives_what_one_by_one_calls_give(server, front):
    client = stemma.connect(server.address if front == "zmq" else server.url, timeout=60)
    try:
        single = client.generate(TEXTS[0], GREEDY)
        assert isinstance(single, stemma.RequestOutput)
        assert isinstance(client.generate(IDS[0], GREEDY), stemma.RequestOutput)
        for prompts in (TEXTS, IDS, [TEXTS[0], IDS[1], TEXTS[2]]):
            expected = one_by_one(client, prompts, [GREEDY] * len(prompts))
            outs = client.generate(prompts, GREEDY)
            assert isinstance(outs, list) and len(outs) == len(prompts)
            same(outs, expected)
            same(asyncio.run(client.agenerate(prompts, GREEDY)), expected)
        # n per prompt, in order; params per prompt; a one-prompt list is a list
        params = [dict(GREEDY, n=2, seed=1), dict(GREEDY, max_new_tokens=3)]
        expected = one_by_one(client, IDS[:2], params)
        assert len(expected) == 3
        same(client.generate(IDS[:2], params), expected)
        same(asyncio.run(client.agenerate(IDS[:2], params)), expected)
        assert len(client.generate([IDS[0]], GREEDY)) == 1
        assert client.generate([], GREEDY) == []
    finally:
        client.close()


AMBIGUOUS = [([1, "a"], "mixes int token ids with str"), ([[5, 6], []], "item 1"),
             ([["a", "b"]], "item 0"), ([[5, "x"]], "item 0"), (None, "got NoneType"),
             (b"abc", "got bytes"), (7, "got int")]


@pytest.mark.parametrize("front", ["zmq", "http"])
def test_ambiguous_input_says_what_was_expected(front):
    """Checked before anything is sent: the address has no server, and the error is at once."""
    port = free_port()
    client = stemma.connect(f"tcp://127.0.0.1:{port}" if front == "zmq" else f"http://127.0.0.1:{port}")
    start = time.monotonic()
    for prompts, why in AMBIGUOUS:
        for call in (lambda: client.generate(prompts), lambda: asyncio.run(client.agenerate(prompts))):
            with pytest.raises(ValueError, match="expected one prompt .* or a list of prompts") as info:
                call()
            assert why in str(info.value)
    with pytest.raises(ValueError, match="params has 1 entries for 2 prompts"):
        client.generate(TEXTS[:2], [GREEDY])
    with pytest.raises(ValueError, match="rid names one request"):
        client.generate(TEXTS[:2], rid="x")
    with pytest.raises(ValueError, match="a stream takes one prompt"):
        client.stream(TEXTS[:2])
    assert time.monotonic() - start < 1.0
    client.close()


def test_a_failing_prompt_in_a_list_fails_the_call_and_the_client_goes_on(server):
    client = stemma.connect(server.address, timeout=60)
    try:
        with pytest.raises(stemma.ServerError, match="bad_request"):
            client.generate([[10 ** 6], IDS[0]], LONG)
        assert client.generate(IDS[1], GREEDY).token_ids
    finally:
        client.close()


def test_a_server_error_sent_to_no_request_aborts_the_requests_it_fails():
    """The server answers a frame whose request id it could not read with an error to no id: the
    client fails every request in flight, and the server may still run them, so giving one up
    aborts it there (it ran on for nobody). An error addressed to a request needs no abort."""
    from stemma.client.core import ClientCore, ServerError
    sent = []
    core = ClientCore("tcp://127.0.0.1:1", b"k", sent.append)
    for rid in ("a", "b"):
        core.start(P.GenerateReq(rid=rid, input_ids=[5]))
    core.received([[P.encode(P.ErrorMsg(rid="", code=P.BAD_REQUEST, message="unreadable frame"))],
                   [P.encode(P.ErrorMsg(rid="b", code=P.BAD_REQUEST, message="its own"))]])
    sent.clear()
    core.give_up("a", ServerError(P.BAD_REQUEST, "unreadable frame"))
    assert [P.decode(frames[-1]) for frames in sent] == [P.Abort(rid="a")]
    core.start(P.GenerateReq(rid="c", input_ids=[5]))
    core.received([[P.encode(P.ErrorMsg(rid="c", code=P.BAD_REQUEST, message="its own"))]])
    sent.clear()
    core.give_up("c", ServerError(P.BAD_REQUEST, "its own"))
    assert sent == []


def test_an_overloaded_answer_to_a_health_call_is_not_healthy_yet():
    """An engine that is exiting answers `overloaded` until its gateway notices; a health wait
    that raised on it stopped a server that was starting (its restart would have served)."""
    from stemma.client.core import ServerError, unhealthy
    assert unhealthy(ServerError(P.OVERLOADED, "the engine's queue is full"))
    assert not unhealthy(ServerError(P.UNAUTHORIZED, "missing or wrong API key"))
