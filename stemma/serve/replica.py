"""One engine process behind the gateway: its supervisor, its two sockets and whether it serves.

    gateway ── PUSH requests[-i] ──▶ engine process i ── PUSH outputs[-i] ──▶ PULL ── gateway

Replica 0 uses the gateway's two addresses as given; replica i > 0 the same with "-i" appended.
With `stemma serve --dp N` each replica runs on its own share of the cores (`cpus`, one thread
each) and, behind the cache-aware router, sends its radix tree's changes (CacheEvents).

Invariants: `serving` is True exactly while a ready engine is attached; `retired` once it died
with no restart left (routing skips it for good); `fd` is the pidfd registered in the gateway's
poller, if any. `backlog` holds the aborts and program ends its full queue refused, in the order
they came, at most one per request or program; it is sent before anything else once the queue
has room, and emptied when the engine dies (a new one never knew those requests).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import zmq

from stemma import protocol as P
from stemma.serve.supervisor import Supervision, Supervisor

INTERNAL_HWM = 100_000    # frames queued towards an engine before clients are told to back off

Control = P.Abort | P.EndProgram  # what no client may be refused: the engine must hear it


def bind(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, INTERNAL_HWM)
    sock.setsockopt(zmq.RCVHWM, INTERNAL_HWM)
    sock.bind(address)
    return sock


def _bound(sock: zmq.Socket) -> str:
    """Where `sock` is bound (a wildcard tcp port resolved)."""
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def address(base: str, index: int) -> str:
    return base if index == 0 else f"{base}-{index}"


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """`parts` disjoint runs of `cpus`, as even as can be; with fewer cpus than parts, the parts
    share them round-robin (one each)."""
    if len(cpus) < parts:
        return [[cpus[i % len(cpus)]] for i in range(parts)]
    return [cpus[i * len(cpus) // parts:(i + 1) * len(cpus) // parts] for i in range(parts)]


class Replica:
    """`make_supervisor(spec)`: what starts and watches its engine, given the engine's full spec
    (a local Supervisor, or a RaySupervisor for an actor); by default a local one."""

    def __init__(self, index: int, ctx: zmq.Context, requests: str, outputs: str,
                 spec: dict[str, Any], supervision: Supervision,
                 make_supervisor: Callable[[dict[str, Any]], Any] | None = None):
        self.index = index
        self.push = bind(ctx, zmq.PUSH, requests)
        self.pull = bind(ctx, zmq.PULL, outputs)
        spec = {**spec, "requests": _bound(self.push), "outputs": _bound(self.pull)}
        self.sup = (make_supervisor or (lambda s: Supervisor(s, supervision)))(spec)
        self.serving = False
        self.retired = False
        self.pid: int | None = None   # the engine that said it was ready
        self.fd: int | None = None
        self.backlog: dict[tuple[str, str], bytes] = {}

    @property
    def name(self) -> str:
        return f"replica {self.index}"

    def send(self, msg: P.Message) -> bool:
        """False when its queue is full (or holds a backlog, which goes first)."""
        return self.flush() and self._push(P.encode(msg))

    def send_control(self, msg: Control) -> None:
        """Sends `msg` now, or as soon as the queue has room (`flush`): an abort that a full
        queue dropped would leave the engine running a request that nobody waits for."""
        key = (msg.TAG, msg.program_id if isinstance(msg, P.EndProgram) else msg.rid)
        frame = P.encode(msg)
        if key in self.backlog or not (self.flush() and self._push(frame)):
            self.backlog.setdefault(key, frame)

    def flush(self) -> bool:
        """Sends the backlog as far as the queue takes it; True once it is empty."""
        while self.backlog:
            key = next(iter(self.backlog))
            if not self._push(self.backlog[key]):
                return False
            del self.backlog[key]
        return True

    def _push(self, frame: bytes) -> bool:
        try:
            self.push.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.sup.stop()
        self.push.close()
        self.pull.close()


def cpu_shares(replicas: int) -> list[list[int] | None]:
    """The cores of each replica: None (all of this process's) for a single one."""
    if replicas == 1:
        return [None]
    return split_cpus(sorted(os.sched_getaffinity(0)), replicas)
