"""The link between the HTTP thread and the gateway loop, inside the gateway process.

    HTTP event loop ── Bridge.send(peer, msg) ──▶ ops deque + a byte on a pipe ──▶ gateway loop
    HTTP event loop ◀── one call_soon_threadsafe per flush ◀── deliver(peer, msg) ◀── gateway loop

Messages cross as the dataclass objects themselves: no codec, no copy, no extra process. The
gateway polls the pipe's read end beside its sockets, so a request wakes it at once. Replies are
held until the gateway's `flush()` (after each burst it handles, so once per engine step), and
then handed to the event loop in one call: one wake-up of the loop per step, not per token.

Invariants: HTTP peers are ints (ZeroMQ peers are bytes), so the two never collide in the
gateway's routing table. A sink is registered before its peer's first message is queued; sinks
of HTTP peers run on the event loop, in the order their messages were delivered, and the
gateway's own sinks (`local_sinks`) run at once on its thread. Once a peer is closed its late
replies are dropped.
"""
from __future__ import annotations

import collections
import itertools
import os
from typing import Any, Callable

Sink = Callable[[Any], None]
SEND, CLOSE = "send", "close"


class Bridge:
    def __init__(self):
        self._ops: collections.deque[tuple[str, int, Any]] = collections.deque()  # thread-safe ends
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._ids = itertools.count(1)
        self.sinks: dict[int, Sink] = {}        # run on `loop`
        self.local_sinks: dict[int, Sink] = {}  # run on the gateway thread
        self.loop: Any = None                   # the HTTP event loop, once it runs
        self._held: list[tuple[Sink, Any]] = []

    @property
    def fd(self) -> int:
        """Readable when ops are queued (the gateway polls it)."""
        return self._read

    # ---- any thread but the gateway's ----
    def open_peer(self, sink: Sink) -> int:
        peer = next(self._ids)
        self.sinks[peer] = sink
        return peer

    def send(self, peer: int, msg: Any) -> None:
        self._ops.append((SEND, peer, msg))
        self._ring()

    def close_peer(self, peer: int) -> None:
        """The peer is gone: the gateway aborts what it still has in flight."""
        self.sinks.pop(peer, None)
        self._ops.append((CLOSE, peer, None))
        self._ring()

    def _ring(self) -> None:
        try:
            os.write(self._write, b"\x01")
        except BlockingIOError:  # the pipe is full of unread rings: the gateway is awake anyway
            pass

    # ---- the gateway thread ----
    def take(self) -> list[tuple[str, int, Any]]:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        ops = []
        while self._ops:
            ops.append(self._ops.popleft())
        return ops

    def deliver(self, peer: int, msg: Any) -> None:
        local = self.local_sinks.get(peer)
        if local is not None:
            local(msg)
            return
        sink = self.sinks.get(peer)
        if sink is not None:
            self._held.append((sink, msg))

    def flush(self) -> None:
        """Hands the held replies to the event loop, in one call."""
        if self._held and self.loop is not None:
            held, self._held = self._held, []
            self.loop.call_soon_threadsafe(_run_sinks, held)

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


def _run_sinks(held: list[tuple[Sink, Any]]) -> None:
    for sink, msg in held:
        sink(msg)
