"""What the sync and asyncio clients share: errors, the socket, building requests, reading replies.

Torch-free: a client imports zmq, msgpack and stemma's light modules only.
"""
from __future__ import annotations

import uuid
from typing import Any, Sequence

import zmq

from stemma import protocol as P
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams

CONNECTION_LOST = "connection_lost"
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


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
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    return sock, monitor


def lost(address: str) -> P.ErrorMsg:
    """The error every waiting request gets when the connection drops."""
    return P.ErrorMsg(rid="", code=CONNECTION_LOST, message=f"lost the connection to {address}")


def frames(key: bytes, msg: P.Message) -> list[bytes]:
    return [key, P.encode(msg)]


def read_reply(raw: list[bytes]) -> P.Message:
    return P.decode(raw[-1], max_bytes=1 << 62)  # replies come from the server we chose to trust


def generate_request(prompt: str | Sequence[int], params: SamplingParams | dict | None, stream: bool,
                     rid: str | None, salt: str | None) -> P.GenerateReq:
    if params is None:
        params = SamplingParams()
    elif isinstance(params, dict):
        params = SamplingParams.from_dict(params)
    rid = rid or new_rid()
    if isinstance(prompt, str):
        return P.GenerateReq(rid=rid, prompt=prompt, params=params, stream=stream, salt=salt)
    return P.GenerateReq(rid=rid, input_ids=[int(t) for t in prompt], params=params, stream=stream,
                         salt=salt)


def to_output(msg: P.Finished, n: int) -> RequestOutput:
    """The RequestOutput of a Finished message; ids of n > 1 siblings get `-index`, as Engine's do."""
    return RequestOutput(
        rid=msg.rid if n == 1 else f"{msg.rid}-{msg.index}", text=msg.text, token_ids=msg.token_ids,
        finish_reason=msg.finish_reason, logprobs=msg.logprobs,
        top_logprobs=[[tuple(t) for t in pos] for pos in msg.top_logprobs] if msg.top_logprobs is not None
        else None,
        prompt_logprobs=msg.prompt_logprobs, meta=msg.meta)


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


class StreamBase:
    """What a sync or async stream of one request holds: its id, the state its chunks build, and
    its RequestOutput once it has ended."""

    def __init__(self, client: Any, rid: str, timeout: float | None):
        self.client = client
        self.rid = rid
        self.timeout = timeout
        self.state = GenerateState(1)
        self.output: RequestOutput | None = None
        self._open = True

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids

    def _fail(self, exc: BaseException) -> None:
        """Ends the stream after an error while reading it; the client aborts the request."""
        self._open = False
        self.client._give_up(self.rid, exc)

    def _settle(self) -> None:
        """Records the output once the last message of the request has been fed."""
        if self.state.done:
            self.output = self.state.result()
            self._open = False
            self.client._finish(self.rid)
