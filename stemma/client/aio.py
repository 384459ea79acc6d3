"""The asyncio transport of the client: one socket per event loop, read by one task that files
each reply under its request. Reached through Client's a-methods (`agenerate`, `astream`, ...).

What each call does is core.ClientCore's; AsyncClient has ClientBase's calls, as coroutines.
"""
from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from stemma import protocol as P
from stemma.client.core import (ClientBase, ClientCore, Op, Run, StreamBase, close_socket, drain,
                                open_socket)


class AsyncStream(StreamBase):
    """Async iterator over the text deltas of one streamed request; like client.Stream.
    Leaving it early (`aclose`, `async with`, a cancelled task) aborts the request."""

    def __aiter__(self) -> "AsyncStream":
        return self

    async def aclose(self) -> None:
        self.close()

    async def __anext__(self) -> str:
        delta = await self._step()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class _Inbox(asyncio.Queue):
    """The replies to one request, as ClientCore files them."""
    append = asyncio.Queue.put_nowait


class AsyncClient(ClientBase):
    _stream = AsyncStream

    def __init__(self, address: str, key: bytes, timeout: float | None,
                 connect_timeout: float | None):
        self.address = address
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
        self._sock, self._monitor = open_socket(ctx, address)
        self._core = ClientCore(address, key, self._send, _Inbox, connect_timeout)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._tasks = [self._loop.create_task(self._read())]

    # ---- the transport ----
    async def _read(self) -> None:
        """The reader task. Its only await is the poll, so a send may take in traffic too."""
        while True:
            await self._poller.poll()
            self._take_in()

    def _take_in(self) -> None:
        """Hands the core every reply and monitor event there is, without waiting."""
        self._core.received(drain(lambda flags: _ready(self._sock, flags)),
                            drain(lambda flags: _ready(self._monitor, flags)))

    def _send(self, frames: list[bytes]) -> None:
        """Sends after taking in what arrived (see ClientCore.start), without awaiting: the send
        queue is unbounded (see open_socket), and this must also work while unwinding a
        cancelled task."""
        if not self._sock.closed:
            self._take_in()
        self._sock.send_multipart(frames).add_done_callback(_raise_later)

    def _alive(self) -> bool:
        return not self._loop.is_closed()

    async def _run(self, op: Op) -> Any:
        run = Run(op)
        while run.wait:
            run.resume(await self._next(*run.wait))
        return run.value

    async def _next(self, rid: str, timeout: float | None) -> P.Message | BaseException:
        """The next reply to request `rid`, or what ended the wait: a RequestTimeout after
        `timeout` seconds, an Unreachable after the connect timeout (see WaitClock), a
        cancellation (thrown on into the operation, which re-raises it)."""
        try:
            inbox = self._core.inbox(rid)
            clock = self._core.clock(timeout, self._loop.time())
            while inbox.empty():
                left = clock.left(self._loop.time())
                try:
                    return await asyncio.wait_for(inbox.get(), left)
                except asyncio.TimeoutError:
                    continue  # clock.left raises if a limit has passed (else the connect limit lifted)
            return inbox.get_nowait()
        except BaseException as exc:
            return exc

    def close(self) -> None:
        """Closes the socket. Requests still in flight are aborted by the server, which sees the
        connection close; this works after the loop has closed, too."""
        self._core.drop_all(abort=False)
        if not self._loop.is_closed():
            for task in self._tasks:
                task.cancel()
        close_socket(self._sock, self._monitor, linger=0)


def _ready(sock: zmq.asyncio.Socket, flags: int) -> list[bytes]:
    """A non-blocking receive: on an asyncio socket, a future that is already done (zmq.Again
    when nothing is there)."""
    return sock.recv_multipart(flags).result()


def _raise_later(future: asyncio.Future) -> None:
    """Surfaces a failed fire-and-forget send through the loop's exception handler."""
    if not future.cancelled() and future.exception() is not None:
        loop = asyncio.get_event_loop()
        loop.call_exception_handler({"message": "stemma client: a send failed",
                                     "exception": future.exception()})
