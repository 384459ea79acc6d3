"""The asyncio side of the client: one socket per event loop, read by one task that files each
reply under its request. Reached through Client's a-methods (`agenerate`, `astream`, ...)."""
from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from stemma import protocol as P
from stemma.client.core import (GenerateState, RequestTimeout, ServerError, StreamBase,
                                        expect, frames, generate_request, info_dict, lost, new_rid,
                                        open_socket, read_reply, unhealthy)
from stemma.outputs import RequestOutput


class AsyncClient:
    def __init__(self, address: str, key: bytes, timeout: float | None):
        self.address = address
        self.timeout = timeout
        self._key = key
        self._loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
        self._sock, self._monitor = open_socket(ctx, address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._tasks = [self._loop.create_task(self._read())]

    # ---- the reader task ----
    async def _read(self) -> None:
        while True:
            events = dict(await self._poller.poll())
            self._read_all()
            if self._monitor in events:
                await self._monitor.recv_multipart()  # the only event subscribed to is DISCONNECTED
                self._read_all()  # what the server sent before closing (say, why) arrived first
                self._broadcast(lost(self.address))

    def _read_all(self) -> None:
        while True:
            try:  # a non-blocking receive on an asyncio socket is a future that is already done
                raw = self._sock.recv_multipart(zmq.NOBLOCK).result()
            except zmq.Again:
                return
            try:
                msg = read_reply(raw)
            except P.ProtocolError as exc:
                self._broadcast(P.ErrorMsg(rid="", code=P.BAD_REQUEST, message=f"bad reply: {exc}"))
                continue
            if isinstance(msg, P.ErrorMsg) and not msg.rid:
                self._broadcast(msg)
            elif msg.rid in self._queues:
                self._queues[msg.rid].put_nowait(msg)

    def _broadcast(self, msg: P.Message) -> None:
        for queue in self._queues.values():
            queue.put_nowait(msg)

    # ---- requests ----
    def _send(self, msg: P.Message) -> None:
        """Sends without awaiting: DEALER queues are deep, and this must also work while unwinding
        a cancelled task."""
        future = self._sock.send_multipart(frames(self._key, msg))
        future.add_done_callback(_raise_later)

    def _start(self, msg: P.Message) -> None:
        if msg.rid in self._queues:
            raise ValueError(f"request id {msg.rid!r} is already in flight")
        self._queues[msg.rid] = asyncio.Queue()
        self._send(msg)

    def _finish(self, rid: str) -> None:
        self._queues.pop(rid, None)

    def _give_up(self, rid: str, exc: BaseException) -> None:
        if isinstance(exc, ServerError) and not isinstance(exc, RequestTimeout):
            self._finish(rid)
        elif rid in self._queues:
            self._finish(rid)
            self._send(P.Abort(rid=rid))

    async def _next(self, rid: str, timeout: float | None) -> P.Message:
        try:
            return await asyncio.wait_for(self._queues[rid].get(), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(timeout) from None

    async def _call(self, msg: P.Message, timeout: float | None) -> P.Message:
        self._start(msg)
        try:
            return await self._next(msg.rid, timeout)
        finally:
            self._finish(msg.rid)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def generate(self, prompt, params=None, *, salt: str | None = None, rid: str | None = None,
                       timeout: float | None = None) -> RequestOutput | list[RequestOutput]:
        msg = generate_request(prompt, params, False, rid, salt)
        state = GenerateState(msg.params.n)
        self._start(msg)
        try:
            while not state.done:
                state.feed(await self._next(msg.rid, self._timeout(timeout)))
        except BaseException as exc:  # includes cancellation: the request is aborted
            self._give_up(msg.rid, exc)
            raise
        self._finish(msg.rid)
        return state.result()

    def stream(self, prompt, params=None, *, salt: str | None = None, rid: str | None = None,
               timeout: float | None = None) -> "AsyncStream":
        msg = generate_request(prompt, params, True, rid, salt)
        self._start(msg)
        return AsyncStream(self, msg.rid, self._timeout(timeout))

    async def abort(self, rid: str) -> None:
        self._send(P.Abort(rid=rid))

    async def flush_cache(self, timeout: float | None) -> bool:
        return expect(await self._call(P.FlushCache(rid=new_rid()), timeout), P.FlushDone).ok

    async def info(self, timeout: float | None) -> dict[str, Any]:
        return info_dict(expect(await self._call(P.GetInfo(rid=new_rid()), timeout), P.Info))

    async def health(self, timeout: float | None) -> bool:
        try:
            expect(await self._call(P.Health(rid=new_rid()), timeout), P.HealthOk)
            return True
        except ServerError as exc:
            if unhealthy(exc):
                return False
            raise

    def close(self) -> None:
        """Closes the socket. Requests still in flight are aborted by the server, which sees the
        connection close; this works after the loop has closed, too."""
        self._queues.clear()
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


class AsyncStream(StreamBase):
    """Async iterator over the text deltas of one streamed request; like client.Stream.
    Leaving it early (`aclose`, `async with`, a cancelled task) aborts the request."""

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> str:
        while self._open:
            try:
                delta = self.state.feed(await self.client._next(self.rid, self.timeout))
            except BaseException as exc:
                self._fail(exc)
                raise
            self._settle()
            if delta:
                return delta
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            self.client._give_up(self.rid, asyncio.CancelledError())

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_open", False) and not self.client._loop.is_closed():
            self.close()
