"""`stemma.connect(address)`: a client of a stemma server, sync and asyncio.

    client = stemma.connect("tcp://127.0.0.1:30000")
    out = client.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    with client.stream("Once upon a time", {"max_new_tokens": 64}) as s:
        for delta in s:
            print(delta, end="")
    out = await client.agenerate(...);  async for delta in client.astream(...): ...

The sync methods use one socket and are not thread-safe (use one client per thread). The async
methods use another socket, one per event loop. A stream that is closed or dropped before it ends,
and an async call that is cancelled, abort their request on the server; a client process that
exits has all its requests aborted by the server, which sees the connection close.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Sequence

import zmq

from stemma import protocol as P
from stemma.client.core import (GenerateState, RequestTimeout, ServerError, StreamBase,
                                        expect, frames, generate_request, info_dict, lost, new_rid,
                                        open_socket, read_reply, unhealthy)
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Params = SamplingParams | dict | None


class Client:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None):
        """`timeout`: seconds to wait for each message of a reply, by default (None: no limit)."""
        self.address = address
        self.timeout = timeout
        self._key = api_key.encode() if api_key else b""
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._inbox: dict[str, deque[P.Message]] = {}  # replies of requests still waited for
        self._async: dict[asyncio.AbstractEventLoop, Any] = {}

    # ---- the socket ----
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock, self._monitor = open_socket(self._ctx, self.address)
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
        return self._sock

    def _send(self, msg: P.Message) -> None:
        self._socket().send_multipart(frames(self._key, msg))

    def _start(self, msg: P.Message) -> None:
        if msg.rid in self._inbox:
            raise ValueError(f"request id {msg.rid!r} is already in flight")
        self._inbox[msg.rid] = deque()
        try:
            self._send(msg)
        except BaseException:
            del self._inbox[msg.rid]
            raise

    def _finish(self, rid: str) -> None:
        self._inbox.pop(rid, None)

    def _pump(self, timeout_s: float | None) -> None:
        """Waits up to `timeout_s` for traffic, then files every reply under its request."""
        ms = None if timeout_s is None else max(int(timeout_s * 1000), 0)
        events = dict(self._poller.poll(ms))
        self._read_all()
        if self._monitor in events:
            self._monitor.recv_multipart()  # the only event subscribed to is DISCONNECTED
            self._read_all()  # what the server sent before closing (say, why) arrived first
            self._broadcast(lost(self.address))

    def _read_all(self) -> None:
        while True:
            try:
                msg = read_reply(self._sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(msg, P.ErrorMsg) and not msg.rid:
                self._broadcast(msg)  # a frame without a readable id failed: fail them all
            elif msg.rid in self._inbox:
                self._inbox[msg.rid].append(msg)

    def _broadcast(self, msg: P.Message) -> None:
        for queue in self._inbox.values():
            queue.append(msg)

    def _next(self, rid: str, timeout: float | None) -> P.Message:
        """The next reply to request `rid`; raises RequestTimeout after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        queue = self._inbox[rid]
        while not queue:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RequestTimeout(timeout)
            self._pump(left)
        return queue.popleft()

    def _call(self, msg: P.Message, timeout: float | None) -> P.Message:
        self._start(msg)
        try:
            return self._next(msg.rid, timeout)
        finally:
            self._finish(msg.rid)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    # ---- generation ----
    def generate(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
                 rid: str | None = None, timeout: float | None = None) -> RequestOutput | list[RequestOutput]:
        """The finished output (a list when params.n > 1). Text or token ids, as Engine.generate."""
        msg = generate_request(prompt, params, False, rid, salt)
        state = GenerateState(msg.params.n)
        self._start(msg)
        try:
            while not state.done:
                state.feed(self._next(msg.rid, self._timeout(timeout)))
        except BaseException as exc:
            self._give_up(msg.rid, exc)
            raise
        self._finish(msg.rid)
        return state.result()

    def stream(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
               rid: str | None = None, timeout: float | None = None) -> "Stream":
        """Text deltas as they are generated; see Stream."""
        msg = generate_request(prompt, params, True, rid, salt)
        self._start(msg)
        return Stream(self, msg.rid, self._timeout(timeout))

    def abort(self, rid: str) -> None:
        """Stops request `rid`; its stream ends with finish_reason 'abort'. Unknown ids are ignored."""
        self._send(P.Abort(rid=rid))

    def _give_up(self, rid: str, exc: BaseException) -> None:
        """After `exc` ended the wait for `rid`: the server already dropped a request it failed;
        anything else (a timeout, an interrupt) leaves it running there, so abort it."""
        if isinstance(exc, ServerError) and not isinstance(exc, RequestTimeout):
            self._finish(rid)
        else:
            self._abandon(rid)

    def _abandon(self, rid: str) -> None:
        """Aborts a request nobody waits for any more, and forgets its replies."""
        if rid in self._inbox:
            self._finish(rid)
            if self._sock is not None and not self._sock.closed:
                self.abort(rid)

    # ---- control ----
    def flush_cache(self, timeout: float | None = 30.0) -> bool:
        """Drops the radix cache; False (and nothing dropped) while requests run."""
        return expect(self._call(P.FlushCache(rid=new_rid()), timeout), P.FlushDone).ok

    def info(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """{'model', 'context_length', 'vocab_size', 'stats'}; stats are the engine's, with pool_whole."""
        return info_dict(expect(self._call(P.GetInfo(rid=new_rid()), timeout), P.Info))

    def health(self, timeout: float | None = 5.0) -> bool:
        """True once the engine loop answers; False on a timeout or a lost connection. Raises
        ServerError for other errors (a wrong API key)."""
        try:
            expect(self._call(P.Health(rid=new_rid()), timeout), P.HealthOk)
            return True
        except ServerError as exc:
            if unhealthy(exc):
                return False
            raise

    # ---- asyncio ----
    def _aclient(self):
        from stemma.client.aio import AsyncClient
        loop = asyncio.get_running_loop()
        if loop not in self._async:
            for old in [lp for lp in self._async if lp.is_closed()]:  # asyncio.run() came and went
                self._async.pop(old).close()
            self._async[loop] = AsyncClient(self.address, self._key, self.timeout)
        return self._async[loop]

    async def agenerate(self, prompt: Prompt, params: Params = None,
                        **kw) -> RequestOutput | list[RequestOutput]:
        return await self._aclient().generate(prompt, params, **kw)

    def astream(self, prompt: Prompt, params: Params = None, **kw):
        """An async iterator of text deltas (an AsyncStream); must be called inside a running loop."""
        return self._aclient().stream(prompt, params, **kw)

    async def aabort(self, rid: str) -> None:
        await self._aclient().abort(rid)

    async def aflush_cache(self, timeout: float | None = 30.0) -> bool:
        return await self._aclient().flush_cache(timeout)

    async def ainfo(self, timeout: float | None = 30.0) -> dict[str, Any]:
        return await self._aclient().info(timeout)

    async def ahealth(self, timeout: float | None = 5.0) -> bool:
        return await self._aclient().health(timeout)

    # ---- lifetime ----
    def close(self) -> None:
        """Aborts whatever is still in flight and closes the sockets."""
        for rid in list(self._inbox):
            self._abandon(rid)
        if self._sock is not None:
            self._monitor.close(linger=0)
            self._sock.close(linger=100)  # lets the aborts out
            self._sock, self._monitor, self._poller = None, None, zmq.Poller()
        for aclient in self._async.values():
            aclient.close()
        self._async.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream(StreamBase):
    """Iterates over the text deltas of one streamed request.

    `rid` names it (for `abort`); `token_ids` grows as chunks arrive; `output` is the
    RequestOutput once the stream has ended. Closing it early (or dropping it) aborts the request.
    """

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        while self._open:
            try:
                delta = self.state.feed(self.client._next(self.rid, self.timeout))
            except BaseException as exc:
                self._fail(exc)
                raise
            self._settle()
            if delta:
                return delta
        raise StopIteration

    def close(self) -> None:
        if self._open:
            self._open = False
            self.client._abandon(self.rid)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_open", False):
            self.close()


def connect(address: str, api_key: str | None = None, timeout: float | None = None) -> Client:
    """A client of the stemma server at `address` (tcp://host:port or ipc://path). Connecting is
    lazy: nothing is sent until the first call."""
    return Client(address, api_key, timeout)
