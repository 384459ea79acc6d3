"""The client, written once: errors, the socket, requests and replies, and every operation.

`ClientCore` is sans-IO. It owns the inboxes of the requests in flight on one socket, builds
their messages, files each reply under its request, and defines each operation once, as a
generator that yields `(rid, timeout)`, "the next reply to request rid, within timeout seconds",
and is sent that reply, or has what ended the wait (a RequestTimeout, an interrupt, a
cancellation) thrown in. `ClientBase` defines the public calls once over it. A transport,
sync.Client (zmq.Poller) or aio.AsyncClient (zmq.asyncio), only sends frames, waits for the next
reply of a request and closes; its `_run` drives an operation (see `Run`) and returns its value,
or, for the async one, an awaitable of it.

Torch-free: a client imports zmq, msgpack and stemma's light modules only.
"""
from __future__ import annotations

import uuid
from collections import deque
from typing import Any, Callable, Generator, Iterable, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from stemma import protocol as P
from stemma.outputs import RequestOutput
from stemma.protocol.transport import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from stemma.sampling_params import SamplingParams

CONNECTION_LOST = "connection_lost"
WRONG_PROTOCOL = "wrong_protocol"  # the address answered, in another protocol than the client's
# what the monitor of a client's socket reports: the connection dropped, or the peer answered but
# its greeting was not ZeroMQ's (an HTTP server, say)
MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
             | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

Prompt = str | Sequence[int]
Params = SamplingParams | dict | None
Wait = tuple[str, float | None]  # what an operation waits for: the next reply to rid, within timeout s
Op = Generator[Wait, P.Message, Any]


class ServerError(RuntimeError):
    """The server refused or failed a request; `code` is one of protocol's error codes."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RequestTimeout(ServerError, TimeoutError):
    """No reply came within the timeout."""

    def __init__(self, seconds: float):
        super().__init__("timeout", f"no reply from the server within {seconds:g} s")


def unhealthy(exc: ServerError) -> bool:
    """Whether a failed health call means "not serving" (a timeout, a lost connection, a dead or
    stopping engine) rather than an error to raise (a wrong API key)."""
    return isinstance(exc, RequestTimeout) or exc.code in (CONNECTION_LOST, P.ENGINE_DEAD, P.SHUTTING_DOWN)


def new_rid() -> str:
    return uuid.uuid4().hex


def open_socket(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to `address`, and a monitor that reports when its connection drops.

    Its receive queue is unbounded, so a client that reads slowly never loses a chunk. ZeroMQ
    heartbeats detect a server that vanished without closing the connection."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(MONITORED)
    sock.connect(address)
    return sock, monitor


def drain(recv: Callable[[int], list[bytes]]) -> Iterable[list[bytes]]:
    """Every message `recv` (a socket's recv_multipart) can give without waiting."""
    while True:
        try:
            yield recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def lost(address: str) -> P.ErrorMsg:
    """The error every waiting request gets when the connection drops."""
    return P.ErrorMsg(rid="", code=CONNECTION_LOST, message=f"lost the connection to {address}")


def not_zmq(address: str) -> P.ErrorMsg:
    """The error every waiting request gets when the peer's greeting is not ZeroMQ's."""
    http = "http://" + address.split("://", 1)[-1]
    return P.ErrorMsg(rid="", code=WRONG_PROTOCOL, message=(
        f"the server at {address} answered, but not in ZeroMQ: is it an HTTP port? Connect to "
        f"{http} for HTTP, or to the server's ZeroMQ port (stemma serve --zmq-port) with tcp://"))


def monitor_error(address: str, event: list[bytes]) -> P.ErrorMsg:
    """What a monitor event (one of MONITORED) means for the requests waiting on the socket."""
    if parse_monitor_message(event)["event"] == zmq.EVENT_DISCONNECTED:
        return lost(address)
    return not_zmq(address)


def frames(key: bytes, msg: P.Message) -> list[bytes]:
    return [key, P.encode(msg)]


def read_reply(raw: list[bytes]) -> P.Message:
    """The message of a reply; an undecodable one becomes an error for every waiting request."""
    try:
        return P.decode(raw[-1], max_bytes=1 << 62)  # replies come from the server we chose to trust
    except P.ProtocolError as exc:
        return P.ErrorMsg(rid="", code=P.BAD_REQUEST, message=f"bad reply: {exc}")


def generate_request(prompt: Prompt, params: Params, stream: bool, rid: str | None,
                     salt: str | None) -> P.GenerateReq:
    if params is None:
        params = SamplingParams()
    elif isinstance(params, dict):
        params = SamplingParams.from_dict(params)
    if stream and params.n != 1:
        raise ValueError(f"n must be 1 when streaming, got {params.n}")
    rid = rid or new_rid()
    if isinstance(prompt, str):
        return P.GenerateReq(rid=rid, prompt=prompt, params=params, stream=stream, salt=salt)
    return P.GenerateReq(rid=rid, input_ids=[int(t) for t in prompt], params=params, stream=stream,
                         salt=salt)


def to_output(msg: P.Finished, n: int) -> RequestOutput:
    """The RequestOutput of a Finished message; ids of n > 1 siblings get `-index`, as Engine's do."""
    return msg.output(msg.rid if n == 1 else f"{msg.rid}-{msg.index}")


def raise_if_error(msg: P.Message) -> P.Message:
    if isinstance(msg, P.ErrorMsg):
        raise ServerError(msg.code, msg.message)
    return msg


def expect(msg: P.Message, kind: type[P.Message]) -> Any:
    raise_if_error(msg)
    if not isinstance(msg, kind):
        raise ServerError(P.BAD_REQUEST, f"expected a {kind.TAG!r} reply, got {msg.TAG!r}")
    return msg


def info_dict(msg: P.Info) -> dict[str, Any]:
    return {"model": msg.model, "context_length": msg.context_length, "vocab_size": msg.vocab_size,
            "stats": msg.stats}


class GenerateState:
    """Folds the replies of one generate request into text deltas and, at the end, its outputs."""

    def __init__(self, n: int):
        self.n = n
        self.token_ids: list[int] = []
        self.outputs: dict[int, RequestOutput] = {}

    @property
    def done(self) -> bool:
        return len(self.outputs) == self.n

    def feed(self, msg: P.Message) -> str:
        """The text delta `msg` carries ('' for none); raises ServerError on an error reply."""
        raise_if_error(msg)
        if isinstance(msg, P.TokenChunk):
            self.token_ids.extend(msg.token_ids)
            return msg.text
        if isinstance(msg, P.Finished):
            self.outputs[msg.index] = to_output(msg, self.n)
            return ""
        raise ServerError(P.BAD_REQUEST, f"unexpected {msg.TAG!r} reply to a generate request")

    def result(self) -> RequestOutput | list[RequestOutput]:
        outs = [self.outputs[i] for i in range(self.n)]
        return outs[0] if self.n == 1 else outs


class Run:
    """Drives one operation: `wait` is what it waits for, None once it has returned `value`
    (an operation that raises raises out of `resume`)."""

    def __init__(self, op: Op):
        self._op = op
        self._step(op.send, None)

    def resume(self, outcome: P.Message | BaseException) -> None:
        """Sends the operation the reply it waited for, or throws in what ended the wait."""
        self._step(self._op.throw if isinstance(outcome, BaseException) else self._op.send, outcome)

    def _step(self, step: Callable[[Any], Wait], arg: Any) -> None:
        try:
            self.wait: Wait | None = step(arg)
        except StopIteration as stop:
            self.wait, self.value = None, stop.value


class ClientCore:
    """The requests in flight on one socket, the replies that came for each, and every operation.

    Sans-IO: `send` (the transport's) puts frames on the wire, the transport hands in what it
    receives (`received`), and `inbox(rid)` is what it takes the next reply to rid from. An inbox
    is a `deque` for the sync client, an asyncio queue with `append` for the async one. Only
    requests still waited for have an inbox; a reply to any other is dropped."""

    def __init__(self, address: str, key: bytes, send: Callable[[list[bytes]], None],
                 new_inbox: Callable[[], Any] = deque):
        self.address = address
        self._key = key
        self._send = send
        self._new_inbox = new_inbox
        self._inbox: dict[str, Any] = {}

    # ---- requests and replies ----
    def send(self, msg: P.Message) -> None:
        self._send(frames(self._key, msg))

    def inbox(self, rid: str) -> Any:
        """Where the replies to `rid` are filed; KeyError once nobody waits for them."""
        return self._inbox[rid]

    def start(self, msg: P.Message) -> None:
        """Sends request `msg`, whose replies are filed from now on."""
        if msg.rid in self._inbox:
            raise ValueError(f"request id {msg.rid!r} is already in flight")
        self._inbox[msg.rid] = self._new_inbox()
        try:
            self.send(msg)
        except BaseException:
            del self._inbox[msg.rid]
            raise

    def finish(self, rid: str) -> None:
        self._inbox.pop(rid, None)

    def give_up(self, rid: str, exc: BaseException) -> None:
        """After `exc` ended the wait for `rid`: the server already dropped a request it failed;
        anything else (a timeout, an interrupt, a cancellation) leaves it running there, so abort it."""
        if isinstance(exc, ServerError) and not isinstance(exc, RequestTimeout):
            self.finish(rid)
        else:
            self.abandon(rid)

    def abandon(self, rid: str) -> None:
        """Aborts a request nobody waits for any more, and forgets its replies."""
        if rid in self._inbox:
            self.finish(rid)
            self.send(P.Abort(rid=rid))

    def drop_all(self, abort: bool) -> None:
        """Forgets every request in flight, aborting each on the server first if `abort`."""
        for rid in list(self._inbox) if abort else ():
            self.abandon(rid)
        self._inbox.clear()

    def received(self, raws: Iterable[list[bytes]], failed: P.ErrorMsg | None = None) -> None:
        """Files each reply in `raws` under its request; then, if the connection `failed` (see
        monitor_error), fails every request still waiting with that error. What the server sent
        before closing (say, why) comes first."""
        for raw in raws:
            msg = read_reply(raw)
            if isinstance(msg, P.ErrorMsg) and not msg.rid:
                self._broadcast(msg)  # a frame without a readable id failed: fail them all
            elif msg.rid in self._inbox:
                self._inbox[msg.rid].append(msg)
        if failed is not None:
            self._broadcast(failed)

    def _broadcast(self, msg: P.Message) -> None:
        for inbox in self._inbox.values():
            inbox.append(msg)

    # ---- operations (see `Run`) ----
    def call(self, msg: P.Message, timeout: float | None) -> Op:
        """The one reply to control request `msg`."""
        self.start(msg)
        try:
            return (yield msg.rid, timeout)
        finally:
            self.finish(msg.rid)

    def fold(self, rid: str, timeout: float | None, state: GenerateState) -> Op:
        """Feeds the next reply to generate request `rid` to `state`, and returns its text delta.
        Forgets the request once its last reply is in; gives it up (see give_up) when the wait
        or the reply fails."""
        try:
            delta = state.feed((yield rid, timeout))
        except BaseException as exc:
            self.give_up(rid, exc)
            raise
        if state.done:
            self.finish(rid)
        return delta

    def generate(self, prompt: Prompt, params: Params, salt: str | None, rid: str | None,
                 timeout: float | None) -> Op:
        msg = generate_request(prompt, params, False, rid, salt)
        state = GenerateState(msg.params.n)
        self.start(msg)
        while not state.done:
            yield from self.fold(msg.rid, timeout, state)
        return state.result()

    def flush_cache(self, timeout: float | None) -> Op:
        return expect((yield from self.call(P.FlushCache(rid=new_rid()), timeout)), P.FlushDone).ok

    def info(self, timeout: float | None) -> Op:
        return info_dict(expect((yield from self.call(P.GetInfo(rid=new_rid()), timeout)), P.Info))

    def health(self, timeout: float | None) -> Op:
        try:
            expect((yield from self.call(P.Health(rid=new_rid()), timeout)), P.HealthOk)
        except ServerError as exc:
            if unhealthy(exc):
                return False
            raise
        return True


class ClientBase:
    """The public calls of a client, each defined once over the transport's `_run`: the sync
    client's returns an operation's value, the async client's an awaitable of it. `_alive()`
    says whether an abort can still be sent (a stream dropped late must not try)."""
    timeout: float | None
    _core: ClientCore
    _stream: type["StreamBase"]
    _run: Callable[[Op], Any]
    _alive: Callable[[], bool]

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
                 rid: str | None = None, timeout: float | None = None) -> RequestOutput | list[RequestOutput]:
        """The finished output (a list when params.n > 1). Text or token ids, as Engine.generate."""
        return self._run(self._core.generate(prompt, params, salt, rid, self._timeout(timeout)))

    def stream(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
               rid: str | None = None, timeout: float | None = None) -> "StreamBase":
        """Text deltas as they are generated; see Stream."""
        msg = generate_request(prompt, params, True, rid, salt)
        self._core.start(msg)
        return self._stream(self, msg.rid, self._timeout(timeout))

    def abort(self, rid: str) -> None:
        """Stops request `rid`; its stream ends with finish_reason 'abort'. Unknown ids are ignored."""
        self._core.send(P.Abort(rid=rid))

    def flush_cache(self, timeout: float | None = 30.0) -> bool:
        """Drops the radix cache; False (and nothing dropped) while requests run."""
        return self._run(self._core.flush_cache(timeout))

    def info(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """{'model', 'context_length', 'vocab_size', 'stats'}; stats are the engine's, with pool_whole."""
        return self._run(self._core.info(timeout))

    def health(self, timeout: float | None = 5.0) -> bool:
        """True once the engine loop answers; False on a timeout or a lost connection. Raises
        ServerError for other errors (a wrong API key)."""
        return self._run(self._core.health(timeout))


class StreamBase:
    """One streamed request, sync or async: its id, the state its chunks build, and its
    RequestOutput once it has ended. Closing it (or dropping it) before then aborts the request."""

    def __init__(self, client: ClientBase, rid: str, timeout: float | None):
        self.client = client
        self.rid = rid
        self.timeout = timeout
        self.state = GenerateState(1)
        self.output: RequestOutput | None = None
        self._open = True

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids

    def _deltas(self) -> Op:
        """The operation behind each step of the iteration: the next non-empty text delta, or
        None once the stream has ended."""
        while self._open:
            try:
                delta = yield from self.client._core.fold(self.rid, self.timeout, self.state)
            except BaseException:
                self._open = False  # fold gave the request up
                raise
            if self.state.done:
                self.output, self._open = self.state.result(), False
            if delta:
                return delta
        return None

    def _step(self) -> Any:
        """The next delta (None at the end); from an async client, an awaitable of it."""
        return self.client._run(self._deltas())

    def close(self) -> None:
        if self._open:
            self._open = False
            self.client._core.abandon(self.rid)

    def __del__(self):
        if getattr(self, "_open", False) and self.client._alive():
            self.close()
