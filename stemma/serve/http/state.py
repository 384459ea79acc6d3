"""What the HTTP routes share: the bridge to the gateway, the tokenizer, the model's facts, the
metrics, the stats history and the API key check. Made by the gateway; lives on the HTTP thread.

Until the engine is ready (`ready()` not yet called) every route but /health and /metrics answers
503, and /health answers 503 too.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
import os
from pathlib import Path
from typing import Any

from fastapi import Request

from stemma import protocol as P
from stemma.serve.http.bridge import Bridge
from stemma.serve.http.errors import ApiError, unavailable
from stemma.serve.metrics import Metrics

HISTORY_SAMPLES = 600      # one a second: the last ten minutes
CALL_TIMEOUT_S = 30.0


class LocalPeer:
    """One HTTP request's end of the bridge: messages to the gateway, its replies in a queue."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge
        self.queue: asyncio.Queue[P.Message] = asyncio.Queue()
        self.id = bridge.open_peer(self.queue.put_nowait)  # runs on the event loop (see Bridge)
        self.closed = False

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
        self.engine: P.EngineReady | None = None
        self.model_id = ""
        self.down: tuple[str, str] | None = None  # (stemma error code, why) once it no longer serves
        self._rids = itertools.count()
        self._salt = os.urandom(4).hex()

    # ---- set by the gateway thread ----
    def ready(self, engine: P.EngineReady, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id_of(engine.model, self.served_name)
        self.engine = engine  # last: routes take `engine is not None` as ready

    def going_down(self, code: str, why: str) -> None:
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
