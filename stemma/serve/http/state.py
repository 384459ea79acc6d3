"""What the HTTP routes share: the bridge to the gateway, the tokenizer, the model's facts, the
metrics, the stats history and the API key check. Made by the gateway; lives on the HTTP thread.

Until the engine is ready (`ready()` not yet called), and while it restarts (`unavailable()` until
the next `ready()`), every route but /health and /metrics answers 503, and /health answers 503 too.

A request's replies wait in its LocalPeer's queue until its handler takes them; a handler that
stops taking them (a streaming client that does not read) is cut off at MAX_QUEUED replies.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
import logging
import os
from pathlib import Path
from typing import Any

from fastapi import Request

from stemma import protocol as P
from stemma.serve.http.bridge import Bridge
from stemma.serve.http.errors import ApiError, unavailable
from stemma.serve.metrics import Metrics
from stemma.text.token_bytes import TokenBytes

logger = logging.getLogger("stemma.serve.http")
HISTORY_SAMPLES = 600      # one a second: the last ten minutes
CALL_TIMEOUT_S = 30.0
MAX_QUEUED = 4096          # replies waiting for one HTTP request before it is cut off


class LocalPeer:
    """One HTTP request's end of the bridge: messages to the gateway, its replies in a queue.

    Invariant: the queue holds at most MAX_QUEUED replies, plus the one cut_off error that
    replaces everything after them (the peer is closed then, which aborts its requests)."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge
        self.queue: asyncio.Queue[P.Message] = asyncio.Queue()
        self.id = bridge.open_peer(self._put)  # runs on the event loop (see Bridge)
        self.closed = False
        self.cut_off = False

    def _put(self, msg: P.Message) -> None:
        if self.cut_off:
            return
        if self.queue.qsize() >= MAX_QUEUED:
            self.cut_off = True
            self.close()
            logger.warning("an HTTP client stopped reading its stream (%d replies wait for it): "
                           "cut off, its requests aborted", MAX_QUEUED)
            msg = P.ErrorMsg(rid="", code=P.CUT_OFF,
                             message=f"the client did not read its stream ({MAX_QUEUED} replies "
                                     f"waited for it): the request was aborted")
        self.queue.put_nowait(msg)

    def send(self, msg: P.Message) -> None:
        self.bridge.send(self.id, msg)

    async def get(self) -> P.Message:
        return await self.queue.get()

    def close(self) -> None:
        """Aborts whatever the request still has running (as a closed ZeroMQ connection does)."""
        if not self.closed:
            self.closed = True
            self.bridge.close_peer(self.id)

    def __enter__(self) -> "LocalPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_id_of(path: str, served_name: str | None) -> str:
    """The id clients name the model by: `served_name`, else the file or folder name."""
    if served_name:
        return served_name
    name = Path(path).name
    return name[:-5] if name.endswith(".gguf") else name


class HttpState:
    def __init__(self, bridge: Bridge, api_key: str | None, metrics: Metrics,
                 served_name: str | None, max_body_bytes: int):
        self.bridge = bridge
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.served_name = served_name
        self.max_body_bytes = max_body_bytes
        self.history: collections.deque[tuple[float, dict[str, Any]]] = collections.deque(
            maxlen=HISTORY_SAMPLES)
        self.tokenizer: Any = None
        self.token_bytes: TokenBytes | None = None
        self.engine: P.EngineReady | None = None
        self.model_id = ""
        self.down: tuple[str, str] | None = None  # (stemma error code, why) while it does not serve
        self._rids = itertools.count()
        self._salt = os.urandom(4).hex()

    # ---- set by the gateway thread ----
    def ready(self, engine: P.EngineReady, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer) if tokenizer is not None else None
        self.model_id = model_id_of(engine.model, self.served_name)
        self.engine = engine  # routes take `engine is not None and down is None` as ready
        self.down = None

    def unavailable(self, code: str, why: str) -> None:
        """Not serving (the engine is restarting, or the server stops) until `ready()` again."""
        self.down = (code, why)

    # ---- used by the routes ----
    def new_rid(self) -> str:
        return f"http-{self._salt}-{next(self._rids)}"

    def check_ready(self) -> None:
        if self.down is not None:
            raise unavailable(*reversed(self.down))
        if self.engine is None:
            raise unavailable("the model is still loading", "loading")

    def open(self) -> LocalPeer:
        self.check_ready()
        return LocalPeer(self.bridge)

    async def call(self, msg: P.Message, timeout: float = CALL_TIMEOUT_S) -> P.Message:
        """Sends a control message (info, flush, health, cache tree) and returns its one reply."""
        with self.open() as peer:
            peer.send(msg)
            try:
                return await asyncio.wait_for(peer.get(), timeout)
            except asyncio.TimeoutError:
                raise unavailable(f"the engine did not answer within {timeout:g} s") from None

    def model_names(self) -> tuple[str, ...]:
        return (self.model_id, self.engine.model) if self.engine is not None else ()

    async def auth(self, request: Request) -> None:
        """The API key check (a FastAPI dependency): `Authorization: Bearer <key>`."""
        if self.key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                           code="unauthorized")
