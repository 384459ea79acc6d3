"""`stemma.connect(address)`: a client of a stemma server, sync and asyncio.

    client = stemma.connect("tcp://127.0.0.1:30000")
    out = client.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    with client.stream("Once upon a time", {"max_new_tokens": 64}) as s:
        for delta in s:
            print(delta, end="")
    out = await client.agenerate(...);  async for delta in client.astream(...): ...

The sync methods use one socket and are not thread-safe (use one client per thread). The async
methods use another socket, one per event loop. No call hangs: until a server has answered, each
wait is bounded by `connect_timeout` (5 s by default; an Unreachable error naming the address),
and a server that goes away is noticed by ZeroMQ heartbeats within seconds (a ServerError with
code 'connection_lost' for every request in flight). A stream that is closed or dropped before it ends,
and an async call that is cancelled, abort their request on the server; a client process that
exits has all its requests aborted by the server, which sees the connection close.

What each call does is core.ClientCore's; this module is its sync transport (a zmq.Poller).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Sequence

import zmq

from stemma import protocol as P
from stemma.client.core import (DEFAULT_CONNECT_TIMEOUT_S, ClientBase, ClientCore, Op, Params,
                                Prompt, Prompts, Run, StreamBase, close_socket, drain,
                                open_socket)
from stemma.client.address import check
from stemma.outputs import RequestOutput

if TYPE_CHECKING:
    from stemma.client.http import HttpClient


class Stream(StreamBase):
    """Iterates over the text deltas of one streamed request.

    `rid` names it (for `abort`); `token_ids` grows as chunks arrive; `output` is the
    RequestOutput once the stream has ended. Closing it early (or dropping it) aborts the request.
    """

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        delta = self._step()
        if delta is None:
            raise StopIteration
        return delta

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client(ClientBase):
    _stream = Stream

    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S):
        """`address`: tcp://host:port or ipc:///path (checked here: see client.address);
        `timeout`: seconds to wait for each message of a reply, by default (None: no limit);
        `connect_timeout`: seconds a wait may last while no server has completed a connection
        (None: no limit)."""
        if check(address) != "zmq":
            raise ValueError(f"a ZeroMQ client needs a tcp:// or ipc:// address, got {address!r}; "
                             f"stemma.connect({address!r}) gives an HTTP client")
        self.address = address
        self.timeout = timeout
        self._key = api_key.encode() if api_key else b""
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None  # opened by the first send
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._core = ClientCore(address, self._key, self._send, connect_timeout=connect_timeout)
        self.connect_timeout = self._core.connect_timeout
        self._async: dict[asyncio.AbstractEventLoop, Any] = {}

    # ---- the transport ----
    def _send(self, frames: list[bytes]) -> None:
        """Sends after taking in what arrived (see ClientCore.start); never blocks (see open_socket)."""
        if self._sock is None:
            self._sock, self._monitor = open_socket(self._ctx, self.address)
            self._core.connected = False
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
        else:
            self._take_in()
        self._sock.send_multipart(frames)

    def _alive(self) -> bool:
        return self._sock is not None and not self._sock.closed

    def _run(self, op: Op) -> Any:
        run = Run(op)
        while run.wait:
            run.resume(self._next(*run.wait))
        return run.value

    def _next(self, rid: str, timeout: float | None) -> P.Message | BaseException:
        """The next reply to request `rid`, or what ended the wait: a RequestTimeout after
        `timeout` seconds, an Unreachable after the connect timeout (see WaitClock), an interrupt."""
        try:
            inbox = self._core.inbox(rid)
            clock = self._core.clock(timeout, time.monotonic())
            while not inbox:
                self._pump(clock.left(time.monotonic()))
            return inbox.popleft()
        except BaseException as exc:
            return exc

    def _pump(self, timeout_s: float | None) -> None:
        """Waits up to `timeout_s` for traffic, then takes it in."""
        ms = None if timeout_s is None else max(int(timeout_s * 1000), 1)  # 0 would spin
        self._poller.poll(ms)
        self._take_in()

    def _take_in(self) -> None:
        """Hands the core every reply and monitor event there is, without waiting."""
        self._core.received(drain(self._sock.recv_multipart), drain(self._monitor.recv_multipart))

    # ---- asyncio ----
    def _aclient(self):
        from stemma.client.aio import AsyncClient
        loop = asyncio.get_running_loop()
        if loop not in self._async:
            for old in [lp for lp in self._async if lp.is_closed()]:  # asyncio.run() came and went
                self._async.pop(old).close()
            self._async[loop] = AsyncClient(self.address, self._key, self.timeout,
                                            self.connect_timeout)
        return self._async[loop]

    async def agenerate(self, prompts: Prompts, params: Params | Sequence[Params] = None,
                        **kw) -> RequestOutput | list[RequestOutput]:
        """As generate: one prompt or a list of them, sent at once."""
        return await self._aclient().generate(prompts, params, **kw)

    def astream(self, prompt: Prompt, params: Params = None, **kw):
        """An async iterator of text deltas (an AsyncStream); must be called inside a running loop."""
        return self._aclient().stream(prompt, params, **kw)

    async def aabort(self, rid: str) -> None:
        self._aclient().abort(rid)

    async def aend_program(self, program_id: str) -> None:
        self._aclient().end_program(program_id)

    async def aflush_cache(self, timeout: float | None = 30.0) -> bool:
        return await self._aclient().flush_cache(timeout)

    async def ainfo(self, timeout: float | None = 30.0) -> dict[str, Any]:
        return await self._aclient().info(timeout)

    async def ahealth(self, timeout: float | None = 5.0) -> bool:
        return await self._aclient().health(timeout)

    # ---- lifetime ----
    def close(self) -> None:
        """Aborts whatever is still in flight and closes the sockets."""
        self._core.drop_all(abort=self._alive())
        if self._sock is not None:
            close_socket(self._sock, self._monitor, linger=100)  # lets the aborts out
            self._sock, self._monitor, self._poller = None, None, zmq.Poller()
        for aclient in self._async.values():
            aclient.close()
        self._async.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str, api_key: str | None = None, timeout: float | None = None,
            connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S) -> Client | HttpClient:
    """A client of the stemma server at `address`: tcp://host:port or ipc://path (its ZeroMQ
    port, a Client), or http://host:port / https://... (its HTTP port, a client.http.HttpClient,
    with the same calls). Connecting is lazy: nothing is sent until the first call, but the
    address is checked here: any other form is a ValueError naming the accepted ones.

    `timeout`: seconds to wait for each reply (None: no limit); `connect_timeout`: seconds a call
    may wait for a server to answer at all, after which it fails with an Unreachable error (code
    'unreachable') naming the address (None: no limit)."""
    if check(address) == "http":
        from stemma.client.http import HttpClient  # imports httpx only when used
        return HttpClient(address, api_key, timeout, connect_timeout)
    return Client(address, api_key, timeout, connect_timeout)
