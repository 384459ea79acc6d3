"""Supervision and backpressure (issue 17): the engine dies or hangs under load, a client stops
reading, a detokenizer fails on one request.

The fault tests run `stemma serve` as a real subprocess on a tiny llama and kill (SIGKILL) or stop
(SIGSTOP) its engine while a ZeroMQ stream, an HTTP stream and a plain HTTP request are in flight.
The backpressure and detokenizer tests drive a Gateway in this process against fake engine
frames, plus a served check that a client which does not read is cut off.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx2
import pytest
import zmq

import stemma
from stemma import protocol as P
from stemma.sampling_params import SamplingParams
from stemma.serve import replica as replica_module
from stemma.serve.gateway import CLIENT_HWM, Gateway, GatewaySpec
from stemma.serve.supervisor import Budget, Supervision, exit_cause
from tests.served import HttpServed, alive, children, cmdline
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

LONG = dict(temperature=0.0, max_new_tokens=1900, ignore_eos=True)  # runs for many seconds
ERROR_WITHIN_S = 5.0
BACK_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("supervision_llama"))
    return str(save_tiny_tokenizer(path))


# ---------------------------------------------------------------- pure parts

def test_exit_causes_name_the_signal_or_status():
    assert exit_cause(1) == "the engine process exited with status 1"
    killed = exit_cause(-signal.SIGKILL)
    assert killed.startswith("the engine process was killed by signal 9 (SIGKILL)")
    assert "out-of-memory" in killed
    assert exit_cause(-signal.SIGSEGV) == "the engine process was killed by signal 11 (SIGSEGV)"


def test_the_restart_budget_is_a_sliding_window():
    now = [0.0]
    budget = Budget(limit=2, window=10.0, clock=lambda: now[0])
    assert budget.take()
    now[0] = 5.0
    assert budget.take()
    now[0] = 9.0
    assert not budget.take()          # two within the last 10 s
    now[0] = 10.5
    assert budget.take()              # the first has left the window
    assert not budget.take()
    assert not Budget(limit=0, window=1.0).take()


def test_supervision_is_validated():
    for bad in (dict(engine_timeout=0), dict(max_restarts=-1), dict(restart_window=0)):
        with pytest.raises(ValueError):
            Supervision(**bad)


# ---------------------------------------------------------------- engine faults, served

class Supervised(HttpServed):
    """`stemma serve` with the gateway and its current engine known."""

    def __init__(self, folder: str, *extra: str):
        super().__init__(folder, *extra)
        self.model = os.path.basename(folder)  # the OpenAI API's model id
        (self.gateway,) = [p for p in self.children if "stemma.serve.gateway" in cmdline(p)]

    def engine(self) -> int:
        (pid,) = [p for p in children(self.gateway) if "stemma.engine.process" in cmdline(p)]
        return pid

    def stop(self) -> int:
        engines = children(self.gateway)
        try:
            return super().stop()
        finally:
            for pid in engines:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


class InFlight:
    """A ZeroMQ stream, an HTTP stream and a plain HTTP completion, each on its thread, all
    running in the engine when the constructor returns; `outcome[name]` = (monotonic time it
    ended, how)."""

    def __init__(self, served: Supervised):
        self.served = served
        self.outcome: dict[str, tuple[float, object]] = {}
        self.started = {name: threading.Event() for name in ("zmq", "http_stream", "http")}
        self.threads = [threading.Thread(target=getattr(self, name), daemon=True)
                        for name in self.started]
        for thread in self.threads:
            thread.start()
        for name, event in self.started.items():
            assert event.wait(30), f"{name} did not start"
        with contextlib.closing(stemma.connect(served.address)) as client:
            deadline = time.monotonic() + 30
            while client.info(timeout=10)["stats"]["running"] < 3:
                assert time.monotonic() < deadline, "the three requests are not all running"
                time.sleep(0.05)

    def zmq(self) -> None:
        with contextlib.closing(stemma.connect(self.served.address)) as client:
            stream = client.stream([5, 6, 7], LONG, timeout=60)
            try:
                for _ in stream:
                    self.started["zmq"].set()
                self.outcome["zmq"] = (time.monotonic(), "finished")
            except stemma.ServerError as exc:
                self.outcome["zmq"] = (time.monotonic(), exc)

    def http_stream(self) -> None:
        body = {"model": self.served.model, "prompt": [8, 9, 10], "stream": True, **_http(LONG)}
        with httpx2.Client(timeout=60) as c, \
                c.stream("POST", self.served.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.started["http_stream"].set()
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    self.outcome["http_stream"] = (time.monotonic(), event["error"])
                    return
            self.outcome["http_stream"] = (time.monotonic(), "finished")

    def http(self) -> None:
        body = {"model": self.served.model, "prompt": [11, 12, 13], **_http(LONG)}
        self.started["http"].set()
        response = httpx2.post(self.served.url + "/v1/completions", json=body, timeout=60)
        self.outcome["http"] = (time.monotonic(), (response.status_code, response.json()))

    def errors(self, since: float) -> dict[str, str]:
        """Each request's error message, checking that it came within ERROR_WITHIN_S of `since`
        and carries the engine_dead code."""
        for thread in self.threads:
            thread.join(ERROR_WITHIN_S + 5)
        out = {}
        for name in self.started:
            assert name in self.outcome, f"{name} got no answer"
            at, how = self.outcome[name]
            assert at - since < ERROR_WITHIN_S, f"{name} ended {at - since:.1f} s after the fault"
            if name == "zmq":
                assert isinstance(how, stemma.ServerError) and how.code == P.ENGINE_DEAD, how
                out[name] = str(how)
            elif name == "http_stream":
                assert isinstance(how, dict) and how["code"] == P.ENGINE_DEAD, how
                out[name] = how["message"]
            else:
                status, body = how
                assert status == 503 and body["error"]["code"] == P.ENGINE_DEAD, how
                out[name] = body["error"]["message"]
        return out


def _http(params: dict) -> dict:
    return {"max_tokens": params["max_new_tokens"], "temperature": params["temperature"],
            "ignore_eos": params["ignore_eos"]}


def served_again(served: Supervised, since: float) -> list[int]:
    """Waits (at most BACK_WITHIN_S after `since`) until /health is 200 and a new request
    succeeds over both fronts; returns the /health statuses seen on the way."""
    statuses = []
    while True:
        assert time.monotonic() - since < BACK_WITHIN_S, f"not back: /health said {statuses[-5:]}"
        status = httpx2.get(served.url + "/health", timeout=5).status_code
        statuses.append(status)
        if status == 200:
            break
        time.sleep(0.1)
    with contextlib.closing(stemma.connect(served.address)) as client:
        assert len(client.generate([5, 6], dict(LONG, max_new_tokens=4), timeout=20).token_ids) == 4
    response = httpx2.post(served.url + "/v1/completions", timeout=20,
                           json={"model": served.model, "prompt": [5, 6],
                                 **_http(dict(LONG, max_new_tokens=4))})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - since < BACK_WITHIN_S
    return statuses


def test_a_killed_engine_fails_its_requests_and_is_restarted_within_budget(folder):
    served = Supervised(folder, "--max-restarts", "1")
    try:
        first = served.engine()
        flight = InFlight(served)
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        for message in flight.errors(killed).values():
            assert "killed by signal 9 (SIGKILL)" in message
            assert "restarting it (restart 1 of 1" in message
        statuses = served_again(served, killed)
        assert statuses[0] == 503 and statuses[-1] == 200
        assert served.engine() != first and not alive(first)

        # The budget is spent: the next death is the end, with a non-zero status.
        flight = InFlight(served)
        os.kill(served.engine(), signal.SIGKILL)
        killed = time.monotonic()
        for message in flight.errors(killed).values():
            assert "not restarting it: it was restarted 1 times" in message
        assert served.proc.wait(20) == 1
    finally:
        served.stop()


def test_a_stopped_engine_is_taken_for_hung_killed_and_restarted(folder):
    served = Supervised(folder, "--engine-timeout", "2")
    try:
        first = served.engine()
        flight = InFlight(served)
        os.kill(first, signal.SIGSTOP)
        stopped = time.monotonic()
        for message in flight.errors(stopped).values():
            assert "sent no heartbeat for" in message and "taken for hung and killed" in message
            assert "restarting it" in message
        statuses = served_again(served, stopped)
        assert statuses[0] == 503 and statuses[-1] == 200
        assert not alive(first) and served.engine() != first
    finally:
        served.stop()


def test_no_restart_exits_with_the_cause(folder):
    served = Supervised(folder, "--no-restart")
    try:
        with contextlib.closing(stemma.connect(served.address)) as client:
            stream = client.stream([5, 6, 7], LONG, timeout=30)
            next(iter(stream))
            os.kill(served.engine(), signal.SIGKILL)
            with pytest.raises(stemma.ServerError, match="not restarting it \\(--no-restart\\)") as info:
                list(stream)
            assert info.value.code == P.ENGINE_DEAD
        assert served.proc.wait(20) == 1
    finally:
        served.stop()


# ---------------------------------------------------------------- clients that do not read, served

@pytest.fixture(scope="module")
def server(folder):
    served = Supervised(folder)
    yield served
    assert served.stop() == 0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def wait_aborted(served: Supervised, before: int, total: int, timeout: float = 60.0) -> dict:
    """The engine's stats once nothing runs; asserts that it ran well short of `total` tokens."""
    with contextlib.closing(stemma.connect(served.address)) as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.info(timeout=10)["stats"]
            if stats["running"] == 0 and stats["queue"] == 0:
                break
            assert time.monotonic() < deadline, f"the unread requests still run: {stats}"
            time.sleep(0.2)
        assert stats["generated_tokens"] - before < total // 2, "they ran to (near) their end"
        assert len(client.generate([5, 6], dict(LONG, max_new_tokens=4), timeout=20).token_ids) == 4
    return stats


def generated(served: Supervised) -> int:
    with contextlib.closing(stemma.connect(served.address)) as client:
        return client.info(timeout=10)["stats"]["generated_tokens"]


def test_a_zeromq_client_that_does_not_read_is_cut_off(server):
    """32 sequences: the gateway queues CLIENT_HWM frames for the client before it cuts it off,
    and a frame holds all of a request's tokens of a step (several under speculation): 16
    sequences once ran to 52% of their tokens by then, in a full suite."""
    before, rss = generated(server), rss_mb(server.gateway)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        for i in range(32):
            sock.send_multipart([b"", P.encode(P.GenerateReq(
                rid=f"r{i}", input_ids=[5, 6, 4 + i], stream=True, params=SamplingParams(**LONG)))])
        wait_aborted(server, before, 32 * LONG["max_new_tokens"])
        assert rss_mb(server.gateway) - rss < 64
    finally:
        sock.close()


def test_an_http_stream_that_is_not_read_is_cut_off(server):
    """48 sequences: the kernel's send buffer alone holds some 20k tokens' events before the
    queue starts to fill, so fewer would finish before they could be cut off."""
    before, rss = generated(server), rss_mb(server.gateway)
    prompts = [[5 + i // 16, 6, 4 + i % 16] for i in range(48)]
    body = json.dumps({"model": server.model, "prompt": prompts, "stream": True,
                       **_http(LONG)}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(12) == b"HTTP/1.1 200"  # and then it reads nothing more
        wait_aborted(server, before, 48 * LONG["max_new_tokens"], timeout=120)
        assert rss_mb(server.gateway) - rss < 64
    finally:
        sock.close()


# ---------------------------------------------------------------- the gateway in this process

@pytest.fixture
def gateway(folder, tmp_path):
    """A Gateway serving `folder`'s tokenizer with no engine process: the test plays the engine
    (`engine` reads what the gateway sends it; frames go in through `feed`)."""
    ipc = f"ipc://{tmp_path}/"
    spec = GatewaySpec(address="tcp://127.0.0.1:0", requests=ipc + "req", outputs=ipc + "out")
    ctx = zmq.Context()
    gw = Gateway(spec, ctx)
    engine = ctx.socket(zmq.PULL)
    engine.setsockopt(zmq.LINGER, 0)
    engine.connect(spec.requests)
    gw.await_link()  # a PUSH with no connection refuses what the tests send
    gw.open(P.EngineReady(model=folder, context_length=2048, vocab_size=96))
    gw.engine_sock = engine
    try:
        yield gw
    finally:
        engine.close()
        gw.close()
        ctx.destroy(linger=0)


def engine_takes(gw: Gateway, kind: type) -> P.Message:
    assert gw.engine_sock.poll(5000), f"the engine got no {kind.__name__}"
    msg = P.decode(gw.engine_sock.recv(), max_bytes=1 << 30)
    assert isinstance(msg, kind), msg
    return msg


def feed(gw: Gateway, *items: P.Message) -> None:
    gw.on_engine(zmq.Frame(P.encode(P.Batch(items=list(items)))))


def open_stream(gw: Gateway, peer: zmq.Socket, rid: str) -> str:
    """`peer` starts a long stream `rid`; the engine id the gateway sent it on under."""
    peer.send_multipart([b"", P.encode(P.GenerateReq(rid=rid, input_ids=[5, 6], stream=True,
                                                     params=SamplingParams(**LONG)))])
    assert gw.router.poll(5000)
    gw._drain(gw.router, gw.on_client_guarded)
    return engine_takes(gw, P.GenerateReq).rid


def test_a_peer_whose_queue_fills_is_cut_off_and_told_once_it_reads(gateway):
    port = gateway.router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
    peer = gateway.ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        gid = open_stream(gateway, peer, "slow")
        sent = 0
        while gateway.routes.get(gid) is not None:  # the engine streams; the peer does not read
            feed(gateway, P.TokenChunk(rid=gid, token_ids=[7]))
            gateway.cut_off_stalled()
            sent += 1
            assert sent < 50 * CLIENT_HWM, "never cut off"
        assert sent >= CLIENT_HWM  # the queue took CLIENT_HWM frames before it counted as full
        assert engine_takes(gateway, P.Abort).rid == gid
        assert len(gateway.routes) == 0 and gateway.owed
        peer.send_multipart([b"", P.encode(P.Health(rid="h"))])
        assert gateway.router.poll(5000)
        gateway._drain(gateway.router, gateway.on_client_guarded)
        assert not gateway.engine_sock.poll(100)  # ignored while it owes an error
        got = []
        deadline = time.monotonic() + 20
        while not got or not isinstance(got[-1], P.ErrorMsg):
            assert time.monotonic() < deadline, f"no error after {len(got)} chunks"
            gateway.pay_owed()
            if peer.poll(10):
                got.append(P.decode(peer.recv_multipart()[-1]))
        assert all(isinstance(m, P.TokenChunk) and m.rid == "slow" for m in got[:-1])
        assert len(got) - 1 < sent  # what the cut-off dropped never reached the peer
        assert got[-1].code == P.CUT_OFF and got[-1].rid == "slow"
        assert not gateway.owed and not peer.poll(200)  # and no reply to the ignored probe
        peer.send_multipart([b"", P.encode(P.Health(rid="h2"))])  # served again once paid
        assert gateway.router.poll(5000)
        gateway._drain(gateway.router, gateway.on_client_guarded)
        assert engine_takes(gateway, P.Health).rid != "h2"  # forwarded under its engine id
    finally:
        peer.close()


@pytest.fixture
def small_queues(monkeypatch):
    """The gateway's queues towards the engine hold 8 frames (request it before `gateway`)."""
    monkeypatch.setattr(replica_module, "INTERNAL_HWM", 8)


def fill_engine_queue(gw: Gateway) -> int:
    """Sends health probes until the engine's queue has refused them for 0.3 s (ZeroMQ's I/O
    thread moves frames on for a moment after the first refusal); how many it took."""
    sent, refused_since = 0, None
    while True:
        if gw.replicas[0].send(P.Health(rid=f"fill{sent}")):
            sent, refused_since = sent + 1, None
            assert sent < 1_000_000, "the queue never filled"
        elif refused_since is None:
            refused_since = time.monotonic()
        elif time.monotonic() - refused_since > 0.3:
            return sent
        else:
            time.sleep(0.005)


def sent_within(attempt, timeout: float = 5.0) -> bool:
    """`attempt()` retried until it is True (the queue has room a moment after the engine read)."""
    deadline = time.monotonic() + timeout
    while not attempt():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def read_fill(gw: Gateway, sent: int) -> None:
    for _ in range(sent):
        engine_takes(gw, P.Health)


def test_an_abort_that_the_full_engine_queue_refused_reaches_it_once_there_is_room(
        small_queues, gateway):
    """Before, the client got `overloaded` for its abort and the engine ran the request on."""
    peer = gateway.ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(gateway.router.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        gid = open_stream(gateway, peer, "a")
        sent = fill_engine_queue(gateway)
        peer.send_multipart([b"", P.encode(P.Abort(rid="a"))])
        peer.send_multipart([b"", P.encode(P.GenerateReq(rid="b", input_ids=[5, 7],
                                                         params=SamplingParams(**LONG)))])
        deadline = time.monotonic() + 5
        while not peer.poll(0):  # the reply to "b" comes after the abort was handled
            assert time.monotonic() < deadline, "no reply"
            if gateway.router.poll(50):
                gateway._drain(gateway.router, gateway.on_client_guarded)
        reply = P.decode(peer.recv_multipart()[-1])
        # the new request is refused while the abort waits; the abort itself gets no reply
        assert isinstance(reply, P.ErrorMsg) and reply.rid == "b" and reply.code == P.OVERLOADED
        assert list(gateway.replicas[0].backlog) == [(P.Abort.TAG, gid)]
        assert not peer.poll(200)
        assert not gateway.replicas[0].flush()  # still full: nothing read yet
        read_fill(gateway, sent)
        assert sent_within(gateway.replicas[0].flush)  # what the gateway's loop does each turn
        assert engine_takes(gateway, P.Abort).rid == gid
        assert not gateway.engine_sock.poll(100)  # once
    finally:
        peer.close()


def test_the_abort_of_a_vanished_client_waits_for_room_in_the_full_engine_queue(
        small_queues, gateway):
    peer = gateway.ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(gateway.router.getsockopt(zmq.LAST_ENDPOINT).decode())
    gid = open_stream(gateway, peer, "a")
    sent = fill_engine_queue(gateway)
    peer.close()
    deadline = time.monotonic() + 10
    while len(gateway.routes):
        assert time.monotonic() < deadline, "the client's going was never noticed"
        gateway.peers.monitor.poll(50)
        gateway.reap()
    assert list(gateway.replicas[0].backlog) == [(P.Abort.TAG, gid)]
    read_fill(gateway, sent)
    assert sent_within(gateway.replicas[0].flush)
    assert engine_takes(gateway, P.Abort).rid == gid


def test_a_dead_engine_s_backlog_is_not_sent_to_its_successor(small_queues, gateway):
    replica = gateway.replicas[0]
    sent = fill_engine_queue(gateway)
    replica.send_control(P.Abort(rid="g1"))
    replica.send_control(P.Abort(rid="g1"))  # one per request
    replica.send_control(P.EndProgram(rid="e", program_id="p1"))
    assert list(replica.backlog) == [(P.Abort.TAG, "g1"), (P.EndProgram.TAG, "p1")]
    read_fill(gateway, sent)
    assert sent_within(lambda: replica.send(P.Health(rid="h")))  # the backlog goes first
    assert engine_takes(gateway, P.Abort).rid == "g1"
    assert engine_takes(gateway, P.EndProgram).program_id == "p1"
    assert engine_takes(gateway, P.Health).rid == "h"
    sent = fill_engine_queue(gateway)
    replica.send_control(P.Abort(rid="g2"))
    assert replica.backlog
    replica.sup.cause = "killed for the test"
    replica.sup.may_restart = lambda last: (False, "no restart in this test")
    gateway._replica_died(replica)
    assert not replica.backlog


class FailingTokenizer:
    """The real tokenizer, except that decoding token 13 raises."""

    def __init__(self, real):
        self.real = real

    def decode(self, ids, **kw):
        if 13 in ids:
            raise OverflowError("token 13 cannot be decoded")
        return self.real.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_detokenizer_error_ends_its_request_only(gateway):
    from stemma.serve.http.bridge import Bridge
    gateway.bridge = bridge = Bridge()
    replies: dict[int, list[P.Message]] = {1: [], 2: []}
    for peer, got in replies.items():
        bridge.local_sinks[peer] = got.append
    gateway.tokenizer = FailingTokenizer(gateway.tokenizer)
    params = SamplingParams(**dict(LONG, max_new_tokens=2))
    gateway.on_message(1, P.GenerateReq(rid="bad", input_ids=[5, 6], params=params, stream=True))
    gateway.on_message(2, P.GenerateReq(rid="good", input_ids=[5, 6], params=params, stream=True))
    bad, good = (engine_takes(gateway, P.GenerateReq).rid for _ in range(2))
    feed(gateway, P.TokenChunk(rid=bad, token_ids=[13]), P.TokenChunk(rid=good, token_ids=[7]))
    feed(gateway, P.TokenChunk(rid=bad, token_ids=[8]), P.TokenChunk(rid=good, token_ids=[8]),
         P.Finished(rid=good, token_ids=[7, 8], finish_reason="length"))
    (error,) = replies[1]
    assert isinstance(error, P.ErrorMsg) and error.rid == "bad" and error.code == P.INTERNAL
    assert "could not turn the engine's output into text" in error.message
    assert "OverflowError: token 13 cannot be decoded" in error.message
    assert engine_takes(gateway, P.Abort).rid == bad
    chunks, finished = replies[2][:-1], replies[2][-1]
    assert [c.token_ids for c in chunks] == [[7], [8]] and all(c.rid == "good" for c in chunks)
    assert isinstance(finished, P.Finished) and finished.token_ids == [7, 8]
    assert finished.text == "".join(c.text for c in chunks)
    assert finished.text.split() == gateway.tokenizer.real.decode([7, 8]).split()
    assert len(gateway.routes) == 0


def test_requests_while_the_engine_restarts_get_engine_dead_at_once(gateway):
    from stemma.serve.http.bridge import Bridge
    gateway.bridge = bridge = Bridge()
    got: list[P.Message] = []
    bridge.local_sinks[1] = got.append
    gateway.on_message(1, P.GenerateReq(rid="before", input_ids=[5, 6], stream=True))
    engine_takes(gateway, P.GenerateReq)
    gateway.serving, gateway.unavailable = False, "the engine process exited with status 1; restarting it"
    gateway.fail_all(P.ENGINE_DEAD, gateway.unavailable)
    gateway.on_message(1, P.Health(rid="probe"))
    gateway.on_message(1, P.GenerateReq(rid="during", input_ids=[5, 6]))
    assert [(m.rid, m.code) for m in got] == [("before", P.ENGINE_DEAD), ("probe", P.ENGINE_DEAD),
                                              ("during", P.ENGINE_DEAD)]
    assert all("exited with status 1; restarting it" in m.message for m in got)
    assert not gateway.engine_sock.poll(100)  # nothing reached the (dead) engine
    gateway.on_engine(zmq.Frame(P.encode(P.EngineReady(model="m", context_length=2048,
                                                       vocab_size=96, pid=1))))
    assert gateway.serving
    gateway.on_message(1, P.Health(rid="after"))
    assert engine_takes(gateway, P.Health)


def test_an_http_peer_holds_at_most_max_queued_replies_then_is_cut_off():
    import asyncio
    from stemma.serve.http.bridge import CLOSE, Bridge
    from stemma.serve.http.state import MAX_QUEUED, LocalPeer

    async def main():
        bridge = Bridge()
        peer = LocalPeer(bridge)
        sink = bridge.sinks[peer.id]
        for i in range(MAX_QUEUED + 10):  # as the gateway delivers them, none taken
            sink(P.TokenChunk(rid="r", token_ids=[i]))
        assert peer.queue.qsize() == MAX_QUEUED + 1
        got = [peer.queue.get_nowait() for _ in range(MAX_QUEUED + 1)]
        assert [m.token_ids[0] for m in got[:-1]] == list(range(MAX_QUEUED))  # in order, none lost
        assert got[-1].code == P.CUT_OFF and "did not read its stream" in got[-1].message
        assert peer.closed and (CLOSE, peer.id, None) in bridge.take()  # which aborts its requests
        bridge.close()

    asyncio.run(main())
