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
from stemma.client.core import (ClientBase, ClientCore, Op, RequestTimeout, Run, StreamBase, drain,
                                monitor_error, open_socket)


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

    def __init__(self, address: str, key: bytes, timeout: float | None):
        self.address = address
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
        self._sock, self._monitor = open_socket(ctx, address)
        self._core = ClientCore(address, key, self._send, _Inbox)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._tasks = [self._loop.create_task(self._read())]

    # ---- the transport ----
    async def _read(self) -> None:
        """The reader task."""
        while True:
            events = dict(await self._poller.poll())
            failed = None
            if self._monitor in events:
                failed = monitor_error(self.address, await self._monitor.recv_multipart())
            self._core.received(drain(self._recv_ready), failed)

    def _recv_ready(self, flags: int) -> list[bytes]:
        # a non-blocking receive on an asyncio socket is a future that is already done
        return self._sock.recv_multipart(flags).result()

    def _send(self, frames: list[bytes]) -> None:
        """Sends without awaiting: DEALER queues are deep, and this must also work while unwinding
        a cancelled task."""
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
        `timeout` seconds, a cancellation (thrown on into the operation, which re-raises it)."""
        try:
            return await asyncio.wait_for(self._core.inbox(rid).get(), timeout)
        except asyncio.TimeoutError:
            return RequestTimeout(timeout)
        except BaseException as exc:
            return exc

    def close(self) -> None:
        """Closes the socket. Requests still in flight are aborted by the server, which sees the
        connection close; this works after the loop has closed, too."""
        self._core.drop_all(abort=False)
        if not self._loop.is_closed():
            for task in self._tasks:
                task.cancel()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


def _raise_later(future: asyncio.Future) -> None:
    """Surfaces a failed fire-and-forget send through the loop's exception handler."""
    if not future.cancelled() and future.exception() is not None:
        loop = asyncio.get_event_loop()
        loop.call_exception_handler({"message": "stemma client: a send failed",
                                     "exception": future.exception()})
