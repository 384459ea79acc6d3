"""A client of a stemma server over HTTP (`stemma serve --port`), with the calls and semantics of
the ZeroMQ client (stemma.client.sync.Client); `stemma.connect("http://host:port")` returns one.

    client = stemma.connect("http://127.0.0.1:30000", api_key="...")
    out = client.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    with client.stream("Once upon a time", {"max_new_tokens": 64}) as s:
        for delta in s:
            print(delta, end="")
    out = await client.agenerate(...);  async for delta in client.astream(...): ...

It speaks the server's native endpoints: POST /generate (a JSON reply, or server-sent events when
streaming), GET /get_server_info, GET /health, POST /flush_cache. The sync calls share one
connection pool and are not thread-safe (use one client per thread); the async calls use another
pool, one per event loop.

Differences that HTTP imposes:
- There is no abort endpoint: the server aborts a request when its connection closes. A stream
  that is closed or dropped early, and an async call that is cancelled, close their connection.
  `abort(rid)` closes this client's stream `rid`, which then ends with a local output whose
  finish_reason is 'abort' (holding what arrived); a non-streamed request cannot be aborted.
- `timeout` bounds each read of the reply, not the gap between two messages; `connect_timeout`
  (5 s by default) bounds opening a connection (an Unreachable error naming the URL).
- A refused or dropped connection is a ServerError with code CONNECTION_LOST. TCP keepalive is the
  heartbeat: a connection to a host that vanished without closing it fails within seconds.
- A list of prompts is sent one request after another by the sync `generate` (it holds no
  threads), all at once by `agenerate`.
"""
from __future__ import annotations

import asyncio
import json
import socket
import weakref
from typing import Any, AsyncIterator, Awaitable, Iterator, Sequence

import httpx2

from stemma import protocol as P
from stemma.client.address import check, speaks_zmtp, zmq_twin
from stemma.client.core import (CONNECTION_LOST, DEFAULT_CONNECT_TIMEOUT_S, WRONG_PROTOCOL, Params,
                                Prompt, Prompts, RequestTimeout, ServerError, Unreachable,
                                check_connect_timeout, gathered, generate_calls,
                                generate_request, unhealthy)
from stemma.outputs import RequestOutput
from stemma.program_call import ProgramCall
from stemma.protocol.transport import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from stemma.text.sse import SSE

_CODES = (P.BAD_REQUEST, P.TOO_LARGE, P.UNAUTHORIZED, P.ENGINE_DEAD, P.SHUTTING_DOWN, P.OVERLOADED,
          P.INTERNAL)
# what an error is when its body names no stemma code: by HTTP status, else by OpenAI error type
_STATUS_CODES = {400: P.BAD_REQUEST, 401: P.UNAUTHORIZED, 403: P.UNAUTHORIZED, 404: P.BAD_REQUEST,
                 405: P.BAD_REQUEST, 413: P.TOO_LARGE, 422: P.BAD_REQUEST, 429: P.OVERLOADED,
                 500: P.INTERNAL, 503: P.SHUTTING_DOWN}
_TYPE_CODES = {"invalid_request_error": P.BAD_REQUEST, "authentication_error": P.UNAUTHORIZED,
               "service_unavailable": P.SHUTTING_DOWN, "internal_error": P.INTERNAL}


# ---- the wire format ----
def request_body(prompt: Prompt, params: Params, stream: bool, rid: str | None, salt: str | None,
                 program: str | None, call: ProgramCall | None = None) -> dict[str, Any]:
    """The JSON body of POST /generate, checked as the ZeroMQ client checks its requests."""
    msg = generate_request(prompt, params, stream, rid, salt, call)
    if program is not None:
        P.GenerateReq(rid=msg.rid, input_ids=[0], program=program)  # checks its length
    body = {"text": msg.prompt, "input_ids": msg.input_ids, "sampling_params": msg.params.to_dict(omit_defaults=True),
            "stream": stream, "rid": msg.rid, "salt": msg.salt, "program": program}
    if call is not None:
        body["program_call"] = call.to_dict()
    return body


def output_from(data: dict[str, Any]) -> RequestOutput:
    """The RequestOutput of its JSON form (top logprobs as [token id, logprob] lists)."""
    try:
        top = data.get("top_logprobs")
        if top is not None:
            top = [[(int(t), float(lp)) for t, lp in pos] for pos in top]
        return RequestOutput(rid=data["rid"], text=data["text"], token_ids=list(data["token_ids"]),
                             finish_reason=data.get("finish_reason"), logprobs=data.get("logprobs"),
                             top_logprobs=top, prompt_logprobs=data.get("prompt_logprobs"),
                             meta=data.get("meta") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerError(P.BAD_REQUEST, f"bad reply: not a request output ({exc!r})") from None


def error_of(status: int | None, error: Any) -> ServerError:
    """The ServerError of an `{"error": {"message", "type", "param", "code"}}` object: its code
    when that is one of stemma's, else the one of the HTTP status (or of the error's type)."""
    message, code, kind, param = None, None, None, None
    if isinstance(error, dict):
        message, code, kind, param = error.get("message"), error.get("code"), error.get("type"), error.get("param")
    elif error is not None:
        message = str(error)
    if code not in _CODES:
        if status is None and isinstance(code, int):
            status = code
        fallback = P.INTERNAL if status is None or status >= 500 else P.BAD_REQUEST
        code = _STATUS_CODES.get(status) or _TYPE_CODES.get(kind) or fallback
    if isinstance(param, str):  # as the engine names it: the SamplingParams field, or the prompt
        param = "prompt" if param in ("text", "input_ids") else param.removeprefix("sampling_params.")
    return ServerError(code, str(message) if message else f"HTTP {status}",
                       param if isinstance(param, str) else None)


def status_error(status: int, content: bytes) -> ServerError:
    """The ServerError of a reply with status >= 400."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return error_of(status, body["error"])
    if isinstance(body, dict) and "detail" in body:  # a framework's own error (a bad path, a 422)
        return error_of(status, {"message": json.dumps(body["detail"])})
    text = content.decode("utf-8", "replace").strip()[:500]
    return error_of(status, {"message": text or f"HTTP {status}"})


def request_bodies(prompts: Prompts, params: Params | Sequence[Params], rid: str | None,
                   salt: str | None, program: str | None,
                   call: ProgramCall | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The bodies of a non-streamed generate call, one per prompt, all checked before any is
    sent (see core.generate_calls), and whether it was given one prompt."""
    calls, single = generate_calls(prompts, params, rid)
    return [request_body(p, sp, False, rid, salt, program, call) for p, sp in calls], single


def as_list(result: RequestOutput | list[RequestOutput]) -> list[RequestOutput]:
    return result if isinstance(result, list) else [result]


async def all_or_none(awaitables: list[Awaitable[Any]]) -> list[Any]:
    """The results of `awaitables`, run at once, in order; if one fails (or this is cancelled),
    the others are cancelled (closing their connections aborts their requests) and its error
    is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def keepalive_options() -> list[tuple[int, int, int]]:
    """TCP keepalive, the HTTP client's heartbeat (the ZeroMQ client's timings): an idle
    connection, such as a stream waiting for its next event, to a host that vanished without
    closing it fails after about HEARTBEAT_TIMEOUT_MS. Options the platform lacks are left out."""
    ivl_s = max(HEARTBEAT_IVL_MS // 1000, 1)
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", ivl_s), ("TCP_KEEPINTVL", ivl_s),
                        ("TCP_KEEPCNT", max(HEARTBEAT_TIMEOUT_MS // HEARTBEAT_IVL_MS, 1))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


def generate_result(data: Any) -> RequestOutput | list[RequestOutput]:
    if isinstance(data, list):
        return [output_from(d) for d in data]
    if isinstance(data, dict):
        return output_from(data)
    raise ServerError(P.BAD_REQUEST, f"bad reply to /generate: {type(data).__name__}")


def info_result(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or not {"model", "context_length", "vocab_size", "stats"} <= set(data):
        raise ServerError(P.BAD_REQUEST, f"bad reply to /get_server_info: {str(data)[:200]}")
    return {k: data[k] for k in ("model", "context_length", "vocab_size", "stats")}


class StreamState:
    """Folds the events of one streamed request into text deltas and its output."""

    def __init__(self, rid: str):
        self.rid = rid
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.output: RequestOutput | None = None
        self.done = False  # [DONE] came

    def feed(self, data: str) -> str:
        """The text delta of one event's data ('' for none); raises ServerError on an error event."""
        if data == "[DONE]":
            self.done = True
            if self.output is None:
                raise ServerError(P.INTERNAL, f"the stream of request {self.rid} ended without its output")
            return ""
        try:
            event = json.loads(data)
        except ValueError:
            raise ServerError(P.BAD_REQUEST, f"bad event in the stream: {data[:200]!r}") from None
        if not isinstance(event, dict):
            raise ServerError(P.BAD_REQUEST, f"bad event in the stream: {data[:200]!r}")
        if "error" in event:
            raise error_of(None, event["error"])
        if "finished" in event:
            self.output = output_from(event["finished"])
            return ""
        self.token_ids.extend(event.get("token_ids") or ())
        delta = event.get("text") or ""
        self.text.append(delta)
        return delta

    def aborted(self) -> RequestOutput:
        """The output of a stream that `abort` ended here: what arrived, finish_reason 'abort'."""
        return RequestOutput(rid=self.rid, text="".join(self.text), token_ids=list(self.token_ids),
                             finish_reason="abort")


def not_http(address: str) -> ServerError:
    return ServerError(WRONG_PROTOCOL, f"the server at {address} speaks ZeroMQ, not HTTP: connect "
                                       f"to {zmq_twin(address)} for it, or to the server's HTTP "
                                       f"port (stemma serve --port) with http://")


def transport_error(exc: Exception, address: str, timeout: float | None,
                    connect_s: float | None = None) -> ServerError:
    """The ServerError of a failed HTTP exchange (`connect_s`: the connect limit it ran under);
    a port that never answered in HTTP is probed, so that a ZeroMQ port given as http:// is named
    as such (see client.address.speaks_zmtp)."""
    if isinstance(exc, httpx2.ConnectTimeout):  # no connection at all: nothing to probe
        within = "in time" if connect_s is None else f"within the connect timeout of {connect_s:g} s"
        return Unreachable(f"cannot connect to {address}: no connection {within} (is `stemma "
                           f"serve` running there?)")
    if isinstance(exc, (httpx2.TimeoutException, httpx2.RemoteProtocolError)) and speaks_zmtp(address):
        return not_http(address)
    if isinstance(exc, httpx2.TimeoutException):
        return RequestTimeout(timeout or 0.0)
    if isinstance(exc, httpx2.ConnectError):
        return ServerError(CONNECTION_LOST, f"cannot connect to {address}: {exc}")
    return ServerError(CONNECTION_LOST, f"lost the connection to {address}: {exc}")


def _ended(address: str) -> ServerError:
    return ServerError(CONNECTION_LOST, f"lost the connection to {address}: the stream ended early")


# ---- streams ----
class HttpStream:
    """Iterates over the text deltas of one streamed request, as client.Stream does: `rid` names it,
    `token_ids` grows as chunks arrive, `output` is the RequestOutput once it has ended. Closing it
    early (or dropping it) closes its connection, which aborts the request on the server."""

    def __init__(self, client: "HttpClient", body: dict[str, Any], timeout: float | None):
        self.client = client
        self.rid = body["rid"]
        self.timeout = timeout
        self.state = StreamState(self.rid)
        self.output: RequestOutput | None = None
        self._sse = SSE()
        self._open = True
        self._error: ServerError | None = None
        self._response: httpx2.Response | None = None
        self._lines: Iterator[str] | None = None
        try:  # sent now, as the ZeroMQ client's are; an error is raised by the first next()
            self._response = client._send_stream(body, timeout)
            self._lines = self._response.iter_lines()
        except ServerError as exc:
            self._error = exc
        client._streams[self.rid] = self

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids

    def __iter__(self) -> "HttpStream":
        return self

    def __next__(self) -> str:
        if self._error is not None:
            error, self._error = self._error, None
            self._end()
            raise error
        while self._open:
            try:
                line = next(self._lines)
            except StopIteration:
                line = None
            except httpx2.TransportError as exc:
                self._end()
                raise transport_error(exc, self.client.address, self.timeout) from exc
            data = self._sse.feed(line) if line is not None else self._sse.flush()
            if data is None:
                if line is None:
                    self._end()
                    raise _ended(self.client.address)
                continue
            try:
                delta = self.state.feed(data)
            except ServerError:
                self._end()
                raise
            if self.state.done:
                self.output = self.state.output
                self._end()
            elif delta:
                return delta
        raise StopIteration

    def _end(self) -> None:
        self._open = False
        self.client._streams.pop(self.rid, None)
        if self._response is not None:
            self._response.close()

    def _abort(self) -> None:
        if self._open:
            self.output = self.state.aborted()
            self._end()

    def close(self) -> None:
        if self._open:
            self._end()

    def __enter__(self) -> "HttpStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_open", False) and self._response is not None:
            self._response.close()


class AsyncHttpStream:
    """Async iterator over the text deltas of one streamed request; like HttpStream. Leaving it
    early (`aclose`, `async with`, a cancelled task) closes its connection, aborting the request."""

    def __init__(self, client: "_AsyncHttp", body: dict[str, Any], timeout: float | None):
        self.client = client
        self.rid = body["rid"]
        self.timeout = timeout
        self.state = StreamState(self.rid)
        self.output: RequestOutput | None = None
        self._sse = SSE()
        self._open = True
        self._aborted = False
        self._response: httpx2.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._loop = asyncio.get_running_loop()
        self._sending = self._loop.create_task(client.send_stream(body, timeout))  # sent now
        client.owner._streams[self.rid] = self

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids

    def __aiter__(self) -> "AsyncHttpStream":
        return self

    async def __anext__(self) -> str:
        try:
            return await self._next()
        except BaseException:
            await self._end()
            raise

    async def _next(self) -> str:
        address = self.client.owner.address
        while self._open and not self._aborted:
            try:
                if self._response is None:
                    self._response = await self._sending
                    self._lines = self._response.aiter_lines()
                    continue
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                line = None
            except asyncio.CancelledError:
                if self._aborted or not self._open:  # abort()/close() cancelled the send (no
                    break                             # headers yet): the stream ends, not the caller
                raise
            except Exception as exc:
                if self._aborted:  # abort() closed the connection under this read
                    break
                if isinstance(exc, httpx2.TransportError):
                    raise transport_error(exc, address, self.timeout) from exc
                raise
            data = self._sse.feed(line) if line is not None else self._sse.flush()
            if data is None:
                if line is None:
                    raise _ended(address)
                continue
            delta = self.state.feed(data)
            if self.state.done:
                self.output = self.state.output
                await self._end()
            elif delta:
                return delta
        await self._end()
        raise StopAsyncIteration

    async def _end(self) -> None:
        if not self._open:
            return
        self._open = False
        self.client.owner._streams.pop(self.rid, None)
        await _close_sent(self._sending)

    def _abort(self) -> None:
        """Ends the stream here, with what arrived; its connection closes at once."""
        if self._open and not self._aborted:
            self._aborted = True
            self.output = self.state.aborted()
            self.close()

    async def aclose(self) -> None:
        await self._end()

    def close(self) -> None:
        """Closes the connection soon (a task on the stream's loop); `aclose` awaits it."""
        if self._open and not self._loop.is_closed():
            self.client.spawn(self._end())

    async def __aenter__(self) -> "AsyncHttpStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._end()

    def __del__(self):
        if getattr(self, "_open", False) and not self._loop.is_closed():
            sending, client = self._sending, self.client
            try:
                self._loop.call_soon_threadsafe(lambda: client.spawn(_close_sent(sending)))
            except RuntimeError:  # the loop closed meanwhile
                pass


async def _close_sent(sending: asyncio.Task) -> None:
    """Closes the response of a stream's request, or stops the request still being sent."""
    if not sending.done():
        sending.cancel()
    elif not sending.cancelled() and sending.exception() is None:
        await sending.result().aclose()


# ---- the client ----
class _AsyncHttp:
    """The async side of an HttpClient on one event loop: its own connection pool."""

    def __init__(self, owner: "HttpClient"):
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        # no idle connections: a loop that closes (asyncio.run, a program's run) leaves none open
        transport = httpx2.AsyncHTTPTransport(limits=httpx2.Limits(max_keepalive_connections=0),
                                              socket_options=keepalive_options())
        self.http = httpx2.AsyncClient(base_url=owner.address, headers=owner._headers,
                                       timeout=owner.timeouts(owner.timeout), transport=transport)
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        """Runs `coro` as a task of this loop that nobody awaits (kept until it is done)."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def request(self, method: str, path: str, timeout: float | None, body: Any = None,
                      ok_statuses: tuple[int, ...] = ()) -> httpx2.Response:
        await self.known_http(timeout)
        try:
            response = await self.http.request(method, path, json=body, timeout=self.owner.timeouts(timeout))
        except httpx2.TransportError as exc:
            raise transport_error(exc, self.owner.address, timeout, self.owner.connect_s(timeout)) from exc
        if response.status_code >= 400 and response.status_code not in ok_statuses:
            raise status_error(response.status_code, response.content)
        return response

    async def known_http(self, timeout: float | None) -> None:
        if timeout is None and not self.owner._http_known:  # the probe blocks: on a thread
            await asyncio.to_thread(self.owner._known_http, timeout)

    async def send_stream(self, body: dict[str, Any], timeout: float | None) -> httpx2.Response:
        await self.known_http(timeout)
        request = self.http.build_request("POST", "/generate", json=body,
                                          timeout=self.owner.timeouts(timeout))
        try:
            response = await self.http.send(request, stream=True)
        except httpx2.TransportError as exc:
            raise transport_error(exc, self.owner.address, timeout, self.owner.connect_s(timeout)) from exc
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx2.TransportError:
                content = b""
            finally:
                await response.aclose()
            raise status_error(response.status_code, content)
        return response

    def close(self) -> None:
        if self.loop.is_closed():
            return  # its connections went with the loop
        if self.loop.is_running():
            self.spawn(self.http.aclose())
        else:
            self.loop.run_until_complete(self.http.aclose())


class HttpClient:
    """A client of the stemma server at `address` (http://host:port or https://...).

    `api_key`: sent as a bearer token; `timeout`: seconds to wait for each read of a reply, by
    default (None: no limit); `connect_timeout`: seconds to wait for a connection to open (None:
    no limit). Connecting is lazy: nothing is sent until the first call."""

    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S):
        if check(address) != "http":
            raise ValueError(f"an HTTP client needs an http:// or https:// address, got {address!r}")
        self.address = address.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = check_connect_timeout(connect_timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: httpx2.Client | None = None  # opened by the first call
        self._http_known = False  # check_protocol found no ZeroMQ port at the address
        self._async: dict[asyncio.AbstractEventLoop, _AsyncHttp] = {}
        self._streams: weakref.WeakValueDictionary[str, HttpStream | AsyncHttpStream] = \
            weakref.WeakValueDictionary()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def connect_s(self, timeout: float | None) -> float | None:
        """The connect limit of a call whose reads wait up to `timeout` s: the shorter one."""
        limits = [t for t in (timeout, self.connect_timeout) if t is not None]
        return min(limits) if limits else None

    def timeouts(self, timeout: float | None) -> httpx2.Timeout:
        """The httpx timeouts of a call: `timeout` for each read, write and pool wait, and
        connect_s(timeout) for the connect."""
        return httpx2.Timeout(timeout, connect=self.connect_s(timeout))

    def check_protocol(self, wait_s: float = 0.2, ask_http: bool = False) -> None:
        """Raises ServerError(WRONG_PROTOCOL) if the address is a ZeroMQ port, which would never
        answer an HTTP request (it greets first; an HTTP server waits): one connection, waiting
        up to `wait_s` for a greeting. A program's backend calls it before its first request."""
        if speaks_zmtp(self.address, wait_s, ask_http):
            raise not_http(self.address)
        self._http_known = True

    def _known_http(self, timeout: float | None) -> None:
        """Before the first call that may wait without a limit: a ZeroMQ port at the address
        would never answer it, and no timeout would end the wait (one short probe, once; an HTTP
        server answers it at once)."""
        if timeout is None and not self._http_known:
            self.check_protocol(wait_s=max(self.connect_timeout or 5.0, 0.2), ask_http=True)

    # ---- the transport ----
    def _client(self) -> httpx2.Client:
        if self._http is None:
            self._http = httpx2.Client(base_url=self.address, headers=self._headers,
                                       timeout=self.timeouts(self.timeout),
                                       transport=httpx2.HTTPTransport(socket_options=keepalive_options()))
        return self._http

    def _request(self, method: str, path: str, timeout: float | None, body: Any = None,
                 ok_statuses: tuple[int, ...] = ()) -> httpx2.Response:
        self._known_http(timeout)
        try:
            response = self._client().request(method, path, json=body, timeout=self.timeouts(timeout))
        except httpx2.TransportError as exc:
            raise transport_error(exc, self.address, timeout, self.connect_s(timeout)) from exc
        if response.status_code >= 400 and response.status_code not in ok_statuses:
            raise status_error(response.status_code, response.content)
        return response

    def _send_stream(self, body: dict[str, Any], timeout: float | None) -> httpx2.Response:
        self._known_http(timeout)
        http = self._client()
        request = http.build_request("POST", "/generate", json=body, timeout=self.timeouts(timeout))
        try:
            response = http.send(request, stream=True)
        except httpx2.TransportError as exc:
            raise transport_error(exc, self.address, timeout, self.connect_s(timeout)) from exc
        if response.status_code >= 400:
            try:
                content = response.read()
            except httpx2.TransportError:
                content = b""
            finally:
                response.close()
            raise status_error(response.status_code, content)
        return response

    def _aclient(self) -> _AsyncHttp:
        loop = asyncio.get_running_loop()
        if loop not in self._async:
            for old in [lp for lp in self._async if lp.is_closed()]:  # asyncio.run() came and went
                del self._async[old]
            self._async[loop] = _AsyncHttp(self)
        return self._async[loop]

    # ---- the calls ----
    def generate(self, prompts: Prompts, params: Params | Sequence[Params] = None, *,
                 salt: str | None = None, rid: str | None = None, timeout: float | None = None,
                 program: str | None = None,
                 call: ProgramCall | None = None) -> RequestOutput | list[RequestOutput]:
        """As Engine.generate: for one prompt (text or token ids) its finished output (a list
        when params.n > 1); for a list of prompts, a list of outputs, n per prompt, in order
        (sent one after another). `params` may be a list, one per prompt."""
        bodies, single = request_bodies(prompts, params, rid, salt, program, call)
        timeout = self._timeout(timeout)
        return gathered([as_list(generate_result(_json(self._request("POST", "/generate", timeout, body))))
                         for body in bodies], single)

    def stream(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
               rid: str | None = None, timeout: float | None = None,
               program: str | None = None, call: ProgramCall | None = None) -> HttpStream:
        """Text deltas as they are generated; see HttpStream."""
        body = request_body(prompt, params, True, rid, salt, program, call)
        return HttpStream(self, body, self._timeout(timeout))

    def abort(self, rid: str) -> None:
        """Ends this client's stream `rid` (its connection closes, which aborts the request on the
        server); its output has finish_reason 'abort'. Other ids are ignored."""
        stream = self._streams.get(rid)
        if stream is not None:
            stream._abort()

    def end_program(self, program_id: str, timeout: float | None = 5.0) -> None:
        """Tells the server that program `program_id` calls no more (stemma.program_call)."""
        self._request("POST", "/end_program", timeout, {"program_id": program_id})

    def flush_cache(self, timeout: float | None = 30.0) -> bool:
        """Drops the radix cache; False (and nothing dropped) while requests run."""
        return bool(_json(self._request("POST", "/flush_cache", timeout)).get("ok"))

    def info(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """{'model', 'context_length', 'vocab_size', 'stats'}; stats are the engine's."""
        return info_result(_json(self._request("GET", "/get_server_info", timeout)))

    def health(self, timeout: float | None = 5.0) -> bool:
        """True when the server answers that it is ready; False on a 503, a timeout or a lost
        connection. Raises ServerError for other errors (a wrong API key)."""
        try:
            return self._request("GET", "/health", timeout, ok_statuses=(503,)).status_code < 400
        except ServerError as exc:
            if unhealthy(exc):
                return False
            raise

    # ---- asyncio ----
    async def agenerate(self, prompts: Prompts, params: Params | Sequence[Params] = None, *,
                        salt: str | None = None, rid: str | None = None,
                        timeout: float | None = None, program: str | None = None,
                        call: ProgramCall | None = None) -> RequestOutput | list[RequestOutput]:
        """As generate, with a list of prompts sent all at once (see all_or_none)."""
        bodies, single = request_bodies(prompts, params, rid, salt, program, call)
        aclient, timeout = self._aclient(), self._timeout(timeout)

        async def one(body: dict[str, Any]) -> list[RequestOutput]:
            return as_list(generate_result(_json(await aclient.request("POST", "/generate", timeout, body))))

        return gathered(await all_or_none([one(body) for body in bodies]), single)

    def astream(self, prompt: Prompt, params: Params = None, *, salt: str | None = None,
                rid: str | None = None, timeout: float | None = None,
                program: str | None = None, call: ProgramCall | None = None) -> AsyncHttpStream:
        """An async iterator of text deltas (an AsyncHttpStream); must be called inside a running loop."""
        body = request_body(prompt, params, True, rid, salt, program, call)
        return AsyncHttpStream(self._aclient(), body, self._timeout(timeout))

    async def aabort(self, rid: str) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream._abort()
            if isinstance(stream, AsyncHttpStream):
                await stream.aclose()

    async def aend_program(self, program_id: str, timeout: float | None = 5.0) -> None:
        await self._aclient().request("POST", "/end_program", timeout, {"program_id": program_id})

    async def aflush_cache(self, timeout: float | None = 30.0) -> bool:
        return bool(_json(await self._aclient().request("POST", "/flush_cache", timeout)).get("ok"))

    async def ainfo(self, timeout: float | None = 30.0) -> dict[str, Any]:
        return info_result(_json(await self._aclient().request("GET", "/get_server_info", timeout)))

    async def ahealth(self, timeout: float | None = 5.0) -> bool:
        try:
            response = await self._aclient().request("GET", "/health", timeout, ok_statuses=(503,))
        except ServerError as exc:
            if unhealthy(exc):
                return False
            raise
        return response.status_code < 400

    # ---- lifetime ----
    def close(self) -> None:
        """Closes every open stream and connection (which aborts what is still in flight)."""
        for stream in list(self._streams.values()):
            if isinstance(stream, HttpStream):
                stream.close()
        if self._http is not None:
            self._http.close()
            self._http = None
        for aclient in self._async.values():
            aclient.close()
        self._async.clear()

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<stemma.HttpClient {self.address}>"


def _json(response: httpx2.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise ServerError(P.BAD_REQUEST, f"bad reply: not JSON ({response.text[:200]!r})") from None
