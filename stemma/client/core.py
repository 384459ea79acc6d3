"""The client, written once: errors, the socket, requests and replies, and every operation.

`ClientCore` is sans-IO. It owns the inboxes of the requests in flight on one socket, builds
their messages, files each reply under its request, and defines each operation once, as a
generator that yields `(rid, timeout)`, "the next reply to request rid, within timeout seconds",
and is sent that reply, or has what ended the wait (a RequestTimeout, an interrupt, a
cancellation) thrown in. `ClientBase` defines the public calls once over it. A transport,
sync.Client (zmq.Poller) or aio.AsyncClient (zmq.asyncio), only sends frames, waits for the next
reply of a request and closes; its `_run` drives an operation (see `Run`) and returns its value,
or, for the async one, an awaitable of it.

No call hangs: until the socket's connection has completed its ZeroMQ handshake, every wait is
also bounded by the connect timeout (an Unreachable error naming the address); once connected,
ZeroMQ heartbeats turn a server that went away into a lost connection within seconds, which fails
every request waiting on the socket. ZeroMQ reconnects by itself, and a call made while it has no
connection gets the connect timeout again (see WaitClock).

Torch-free: a client imports zmq, msgpack and stemma's light modules only.
"""
from __future__ import annotations

import numbers
import uuid
from collections import deque
from typing import Any, Callable, Generator, Iterable, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from stemma import protocol as P
from stemma.outputs import RequestOutput
from stemma.program_call import ProgramCall
from stemma.protocol.transport import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, ipv6_literal
from stemma.sampling_params import SamplingParams

CONNECTION_LOST = "connection_lost"
WRONG_PROTOCOL = "wrong_protocol"  # the address answered, in another protocol than the client's
UNREACHABLE = "unreachable"  # no server completed a connection within the connect timeout
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# what the monitor of a client's socket reports: a connection completed its handshake, it dropped,
# or the peer answered but its greeting was not ZeroMQ's (an HTTP server, say)
MONITORED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
EXPECTED_PROMPTS = ("one prompt (a str, or a non-empty list of int token ids) or a list of prompts "
                    "(strs and/or non-empty lists of int token ids)")

Prompt = str | Sequence[int]
Prompts = Prompt | Sequence[Prompt]
Params = SamplingParams | dict | None
Wait = tuple[str, float | None]  # what an operation waits for: the next reply to rid, within timeout s
Op = Generator[Wait, P.Message, Any]


class ServerError(RuntimeError):
    """The server refused or failed a request; `code` is one of protocol's error codes, `param`
    the request field it was refused for, where the server names one."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param


class RequestTimeout(ServerError, TimeoutError):
    """No reply came within the timeout."""

    def __init__(self, seconds: float):
        super().__init__("timeout", f"no reply from the server within {seconds:g} s")


class Unreachable(RequestTimeout):
    """No server completed a connection within the connect timeout; code UNREACHABLE. A kind of
    RequestTimeout: the request may still reach a server that comes up later, so it is aborted."""

    def __init__(self, message: str):
        ServerError.__init__(self, UNREACHABLE, message)


def unreachable(address: str, seconds: float) -> Unreachable:
    return Unreachable(f"no ZeroMQ server answered at {address} within the connect timeout of "
                       f"{seconds:g} s (is `stemma serve` running there, and is this its --zmq-port?)")


def check_connect_timeout(seconds: float | None) -> float | None:
    if seconds is not None and not seconds > 0:
        raise ValueError(f"connect_timeout must be > 0 seconds (or None: no limit), got {seconds!r}")
    return seconds


def unhealthy(exc: ServerError) -> bool:
    """Whether a failed health call means "not serving" (a timeout, an unreachable address, a lost
    connection, a dead, stopping or full engine: one that is exiting answers `overloaded` until its
    gateway notices) rather than an error to raise (a wrong API key)."""
    return isinstance(exc, RequestTimeout) or exc.code in (CONNECTION_LOST, P.ENGINE_DEAD, P.SHUTTING_DOWN,
                                                           P.OVERLOADED)


def new_rid() -> str:
    return uuid.uuid4().hex


def open_socket(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to `address`, and a monitor that reports when its connection drops.

    Its receive queue is unbounded, so a client that reads slowly never loses a chunk; so is its
    send queue, so a send never blocks: requests to a server not reached yet wait there until the
    connect timeout fails them. ZeroMQ heartbeats detect a server that vanished without closing
    the connection."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    if ipv6_literal(address):  # tcp://[::1]:port
        sock.setsockopt(zmq.IPV6, 1)
    # an inproc address of its own: pyzmq's default derives it from the socket's descriptor,
    # which the monitor endpoint of a socket closed just before may still hold (EADDRINUSE)
    monitor = sock.get_monitor_socket(MONITORED, addr=f"inproc://stemma-client-monitor-{uuid.uuid4().hex}")
    sock.connect(address)
    return sock, monitor


def close_socket(sock: zmq.Socket, monitor: zmq.Socket, linger: int) -> None:
    """Closes what open_socket opened: stops the monitor (which releases its endpoint), closes
    the monitor's socket, then the DEALER, which keeps unsent frames for `linger` ms."""
    if not sock.closed:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
    monitor.close(linger=0)
    sock.close(linger=linger)


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


def monitor_error(address: str, event: int) -> P.ErrorMsg | None:
    """What a monitor event (one of MONITORED) means for the requests waiting on the socket:
    nothing for a completed handshake, else the error each of them gets."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    if event == zmq.EVENT_DISCONNECTED:
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
                     salt: str | None, call: ProgramCall | None = None) -> P.GenerateReq:
    if params is None:
        params = SamplingParams()
    elif isinstance(params, dict):
        params = SamplingParams.from_dict(params)
    if stream and params.n != 1:
        raise ValueError(f"n must be 1 when streaming, got {params.n}")
    rid = rid or new_rid()
    if isinstance(prompt, str):
        return P.GenerateReq(rid=rid, prompt=prompt, params=params, stream=stream, salt=salt, call=call)
    if not is_one_prompt(prompt):
        raise ValueError(f"expected one prompt (a str or a non-empty list of int token ids; a "
                         f"stream takes one prompt), got {describe(prompt)}")
    return P.GenerateReq(rid=rid, input_ids=[int(t) for t in prompt], params=params, stream=stream,
                         salt=salt, call=call)


# ---- what generate accepts: Engine.generate's rules (stemma.engine.engine.is_single) ----
def is_one_prompt(prompt: object) -> bool:
    """Text, or a non-empty sequence of ints (token ids), is one prompt."""
    return isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)) and len(prompt) > 0
        and all(isinstance(t, numbers.Integral) for t in prompt))


def describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def split_prompts(prompts: object) -> tuple[list[Prompt], bool]:
    """The prompts of a generate call, and whether it was given one prompt rather than a list.
    A list of prompts may mix text and token ids; an empty list is no prompts, as for Engine.
    Anything else (a list mixing ids and prompts, an empty id list among prompts) is a
    ValueError saying what was expected."""
    if is_one_prompt(prompts):
        return [prompts], True
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"generate expected {EXPECTED_PROMPTS}, got {describe(prompts)}")
    ints = [t for t in prompts if isinstance(t, numbers.Integral)]
    if ints:
        odd = next(t for t in prompts if not isinstance(t, numbers.Integral))
        raise ValueError(f"generate expected {EXPECTED_PROMPTS}; the list mixes int token ids "
                         f"with {describe(odd)}")
    for i, prompt in enumerate(prompts):
        if not is_one_prompt(prompt):
            raise ValueError(f"generate expected {EXPECTED_PROMPTS}; item {i} of the list is "
                             f"{describe(prompt)}, which is neither")
    return list(prompts), False


def params_per_prompt(params: Params | Sequence[Params], count: int) -> list[Params]:
    """One params per prompt: a list gives each its own (as Engine.generate), else all share one."""
    if isinstance(params, (list, tuple)):
        if len(params) != count:
            raise ValueError(f"params has {len(params)} entries for {count} prompts")
        return list(params)
    return [params] * count


def generate_calls(prompts: Prompts, params: Params | Sequence[Params],
                   rid: str | None) -> tuple[list[tuple[Prompt, Params]], bool]:
    """The (prompt, params) of each request of a non-streamed generate call (see split_prompts,
    params_per_prompt), and whether it was given one prompt."""
    plist, single = split_prompts(prompts)
    if rid is not None and not single:
        raise ValueError(f"rid names one request, but generate was given {len(plist)} prompts; "
                         f"leave rid None (each prompt gets its own id)")
    return list(zip(plist, params_per_prompt(params, len(plist)))), single


def generate_requests(prompts: Prompts, params: Params | Sequence[Params], rid: str | None,
                      salt: str | None, call: ProgramCall | None = None) -> tuple[list[P.GenerateReq], bool]:
    """The requests of a non-streamed generate call, all checked before any is sent, and
    whether it was given one prompt."""
    calls, single = generate_calls(prompts, params, rid)
    return [generate_request(p, sp, False, rid, salt, call) for p, sp in calls], single


def gathered(outputs: list[list[RequestOutput]], single: bool) -> RequestOutput | list[RequestOutput]:
    """What generate returns, as Engine.generate: one output for one prompt with n == 1, else the
    outputs of every prompt in order, n per prompt."""
    flat = [out for outs in outputs for out in outs]
    return flat[0] if single and len(flat) == 1 else flat


def to_output(msg: P.Finished, n: int) -> RequestOutput:
    """The RequestOutput of a Finished message; ids of n > 1 siblings get `-index`, as Engine's do."""
    return msg.output(msg.rid if n == 1 else f"{msg.rid}-{msg.index}")


def raise_if_error(msg: P.Message) -> P.Message:
    if isinstance(msg, P.ErrorMsg):
        raise ServerError(msg.code, msg.message, msg.param)
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

    def in_order(self) -> list[RequestOutput]:
        return [self.outputs[i] for i in range(self.n)]

    def result(self) -> RequestOutput | list[RequestOutput]:
        outs = self.in_order()
        return outs[0] if self.n == 1 else outs


class WaitClock:
    """The limits of one wait for a reply, read on the transport's clock (`now`): `timeout`
    seconds in all (None: none), and, while the socket has no connection that completed its
    handshake, `connect_timeout` seconds from the start of the wait (None: none). The connect
    limit lifts as soon as a connection is up, and applies again to waits that start after it
    dropped, so a call made while ZeroMQ reconnects cannot hang either."""

    def __init__(self, core: "ClientCore", timeout: float | None, now: float):
        self._core = core
        self._timeout = timeout
        self._deadline = None if timeout is None else now + timeout
        connect = core.connect_timeout
        self._connect_by = None if connect is None else now + connect

    def left(self, now: float) -> float | None:
        """Seconds the wait may go on before it is checked again (None: no limit); raises
        RequestTimeout or Unreachable once a limit has passed."""
        limits = []
        if self._deadline is not None:
            if now >= self._deadline:
                raise RequestTimeout(self._timeout)
            limits.append(self._deadline - now)
        if self._connect_by is not None and not self._core.connected:
            if now >= self._connect_by:
                raise unreachable(self._core.address, self._core.connect_timeout)
            limits.append(self._connect_by - now)
        return min(limits) if limits else None


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
                 new_inbox: Callable[[], Any] = deque,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S):
        self.address = address
        self.connect_timeout = check_connect_timeout(connect_timeout)
        # whether the socket has a connection that completed its handshake, by the monitor's last
        # event; a transport that opens a new socket sets it back to False
        self.connected = False
        self._key = key
        self._send = send
        self._new_inbox = new_inbox
        self._inbox: dict[str, Any] = {}
        # requests failed by a server error sent to no request id (a frame whose id the server
        # could not read): it may still run them, so giving one up aborts it
        self._unsure: set[str] = set()

    def clock(self, timeout: float | None, now: float) -> WaitClock:
        """The limits of a wait for a reply that starts `now`."""
        return WaitClock(self, timeout, now)

    # ---- requests and replies ----
    def send(self, msg: P.Message) -> None:
        self._send(frames(self._key, msg))

    def inbox(self, rid: str) -> Any:
        """Where the replies to `rid` are filed; KeyError once nobody waits for them."""
        return self._inbox[rid]

    def start(self, msg: P.Message) -> None:
        """Sends request `msg`, whose replies are filed from now on. The inbox opens after the
        send, because a transport's send first takes in what arrived (see `received`): a drop
        reported by then fails the requests already in flight, not this one, which ZeroMQ
        delivers once it has reconnected."""
        if msg.rid in self._inbox:
            raise ValueError(f"request id {msg.rid!r} is already in flight")
        self.send(msg)
        self._inbox[msg.rid] = self._new_inbox()

    def finish(self, rid: str) -> None:
        self._inbox.pop(rid, None)
        self._unsure.discard(rid)

    def give_up(self, rid: str, exc: BaseException) -> None:
        """After `exc` ended the wait for `rid`: the server already dropped a request it failed;
        anything else (a timeout, an unreachable server that may yet get it, an interrupt, a
        cancellation) leaves it running there, so abort it."""
        if isinstance(exc, ServerError) and not isinstance(exc, RequestTimeout) and rid not in self._unsure:
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
        self._unsure.clear()

    def received(self, raws: Iterable[list[bytes]], events: Iterable[list[bytes]] = ()) -> None:
        """Takes in the socket's monitor `events` (which say whether it is connected) and files
        each reply in `raws` under its request; then every connection failure among the events
        (see monitor_error) fails each request still waiting. What the server sent before
        closing (say, why) comes first."""
        failures = [f for f in map(self._follow, events) if f is not None]
        for raw in raws:
            msg = read_reply(raw)
            if isinstance(msg, P.ErrorMsg) and not msg.rid:
                self._unsure.update(self._inbox)
                self._broadcast(msg)  # a frame without a readable id failed: fail them all
            elif msg.rid in self._inbox:
                self._inbox[msg.rid].append(msg)
        for failure in failures:
            self._broadcast(failure)

    def _follow(self, raw_event: list[bytes]) -> P.ErrorMsg | None:
        """Updates `connected` from one monitor event; returns the failure it means, if any."""
        event = parse_monitor_message(raw_event)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
        return monitor_error(self.address, event)

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

    def generate(self, prompts: Prompts, params: Params | Sequence[Params], salt: str | None,
                 rid: str | None, timeout: float | None, call: ProgramCall | None = None) -> Op:
        """One request per prompt, all sent at once, gathered in order (see `gathered`). If one
        fails, the others still in flight are aborted and its error is raised."""
        msgs, single = generate_requests(prompts, params, rid, salt, call)
        states = [GenerateState(msg.params.n) for msg in msgs]
        sent: list[str] = []
        try:
            for msg in msgs:
                self.start(msg)
                sent.append(msg.rid)
            for msg, state in zip(msgs, states):
                while not state.done:
                    yield from self.fold(msg.rid, timeout, state)
        except BaseException:
            for other in sent:
                self.abandon(other)  # a no-op for the finished ones and the one that failed
            raise
        return gathered([state.in_order() for state in states], single)

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

    def generate(self, prompts: Prompts, params: Params | Sequence[Params] = None, *,
                 salt: str | None = None, rid: str | None = None,
                 timeout: float | None = None,
                 call: ProgramCall | None = None) -> RequestOutput | list[RequestOutput]:
        """As Engine.generate: for one prompt (text or token ids) its finished output (a list
        when params.n > 1); for a list of prompts, a list of outputs, n per prompt, in order.
        `params` may be a list, one per prompt. `call`: the program context of every request
        (stemma.program_call)."""
        return self._run(self._core.generate(prompts, params, salt, rid, self._timeout(timeout), call))

    def stream(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
               rid: str | None = None, timeout: float | None = None,
               call: ProgramCall | None = None) -> "StreamBase":
        """Text deltas as they are generated; see Stream."""
        msg = generate_request(prompt, params, True, rid, salt, call)
        self._core.start(msg)
        return self._stream(self, msg.rid, self._timeout(timeout))

    def abort(self, rid: str) -> None:
        """Stops request `rid`; its stream ends with finish_reason 'abort'. Unknown ids are ignored."""
        self._core.send(P.Abort(rid=rid))

    def end_program(self, program_id: str) -> None:
        """Tells the server that program `program_id` calls no more (no reply): a program-aware
        server evicts its KV first."""
        self._core.send(P.EndProgram(rid=new_rid(), program_id=program_id))

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
