"""Connection churn at the ZeroMQ port: clients that connect, stream and close at once, beside
steady ones, must each get their stream (a regression: the gateway's peer watch once took the
disconnect of an old connection for that of a new one on the same reused descriptor, and aborted
the new client's request without a word, so its stream never started)."""
from __future__ import annotations

import asyncio
import collections
import time

import pytest
import zmq

from stemma.client.core import RequestTimeout, close_socket, open_socket
from stemma.client.sync import connect
from stemma.serve.peer_watch import PeerWatch, source_fd
from tests.served import HttpServed
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

CHURN_S = 20
LONG = {"temperature": 0.0, "max_new_tokens": 100, "ignore_eos": True}
SHORT = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def test_a_new_peer_on_a_reused_descriptor_is_not_taken_for_the_old_one():
    """The race itself, made deterministic: a client's connection closes, a new client gets the
    same descriptor and sends before the gateway reads the monitor; only the old one is gone."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    watch = PeerWatch(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    dealers: list[zmq.Socket] = []

    def exchange() -> tuple[zmq.Socket, bytes, int]:
        dealer = ctx.socket(zmq.DEALER)
        dealers.append(dealer)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        dealer.send(b"hello")
        assert router.poll(5000)
        identity, body = router.recv_multipart(copy=False)
        watch.seen(identity.bytes, body)
        return dealer, identity.bytes, source_fd(body)

    try:
        old, old_id, fd = exchange()
        old.close()
        assert watch.monitor.poll(5000)  # its DISCONNECTED is queued, not read yet
        new, new_id, new_fd = exchange()
        if new_fd != fd:
            pytest.skip("the kernel gave the new connection another descriptor")
        assert watch.gone() == [old_id]
        assert watch.fd_of == {new_id: fd}
        new.close()
        deadline = time.monotonic() + 5
        gone: list[bytes] = []
        while not gone and time.monotonic() < deadline:
            watch.monitor.poll(100)
            gone = watch.gone()
        assert gone == [new_id]
    finally:
        for dealer in dealers:
            dealer.close()
        watch.close()
        router.close()
        ctx.term()


def test_client_sockets_open_and_close_without_monitor_clashes():
    """Each client socket's monitor has an inproc address of its own (pyzmq's default, from the
    socket's descriptor, may still be held by a socket just closed), and closing stops it."""
    ctx = zmq.Context()
    try:
        for _ in range(300):
            sock, monitor = open_socket(ctx, "tcp://127.0.0.1:9")
            close_socket(sock, monitor, linger=0)
            assert sock.closed and monitor.closed
    finally:
        ctx.term()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("churn_llama"))))
    served = HttpServed(folder, engine=dict(max_context=256))
    yield served
    served.stop()


def test_streams_on_fresh_connections_are_never_lost(server):
    prompt = " ".join(words()[:6])

    async def churn(until: float, out: collections.Counter) -> None:
        while time.monotonic() < until:
            own = connect(server.address)
            try:
                stream = own.astream(prompt, LONG, timeout=15)
                await stream.__anext__()
                out["ok"] += 1
            except RequestTimeout as exc:
                out[f"lost ({type(exc).__name__}: {exc})"] += 1
            except Exception as exc:
                out[f"{type(exc).__name__}: {exc}"] += 1
            finally:
                own.close()

    async def load(until: float, out: collections.Counter) -> None:
        client = connect(server.address)
        try:
            while time.monotonic() < until:
                await client.agenerate(prompt, SHORT, timeout=15)
                out["steady"] += 1
        finally:
            client.close()

    async def main() -> collections.Counter:
        out: collections.Counter = collections.Counter()
        until = time.monotonic() + CHURN_S
        await asyncio.gather(*[churn(until, out) for _ in range(16)],
                             *[load(until, out) for _ in range(16)])
        return out

    out = asyncio.run(main())
    assert set(out) == {"ok", "steady"}, dict(out)
    assert out["ok"] >= 100, dict(out)
