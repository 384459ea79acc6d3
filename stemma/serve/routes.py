"""The gateway's routing table: which client asked for what, under the id the engine knows it by.

Clients choose their own request ids, so two clients may use the same one. The gateway gives
every request a fresh engine-side id (`gid`) and maps it back to (client identity, client rid).
Each request is on one replica (`replica`), or spread over several (`replica` -1, `expect`: the
replicas whose answer it still waits for); the generate requests on a replica are its load.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Pending:
    """A client request in flight. For generate requests, `texts` holds one TextStream per sequence."""
    peer: bytes | int                # a ZeroMQ identity, or an HTTP request's bridge peer
    rid: str
    kind: str                        # the request's message tag
    stream: bool = False
    n: int = 1
    input_ids: list[int] = field(default_factory=list)
    params: Any = None               # SamplingParams (generate requests)
    texts: dict[int, Any] = field(default_factory=dict)
    done: int = 0                    # sequences finished so far (of n)
    program: str | None = None       # the frontend program that sent it
    replica: int = 0                 # the replica serving it; -1: spread over `expect`
    expect: set[int] | None = None   # a spread request: the replicas yet to answer
    parts: dict[int, Any] = field(default_factory=dict)  # a spread request: answers so far


def in_flight(rid: str) -> str:
    """The error for a request id the client already has in flight."""
    return f"request id {rid!r} is already in flight on this connection"


class Routes:
    def __init__(self):
        self._ids = itertools.count()
        self._by_gid: dict[str, Pending] = {}
        self._by_client: dict[tuple[bytes | int, str], str] = {}
        self._by_peer: dict[bytes | int, set[str]] = {}
        self._by_replica: dict[int, set[str]] = {}   # replica (-1: spread) -> its gids
        self._generating: dict[int, int] = {}        # replica -> generate requests on it

    def __len__(self) -> int:
        return len(self._by_gid)

    def add(self, pending: Pending) -> str:
        """Registers `pending`; returns its engine-side id. Raises ValueError if the client
        already has a request in flight under the same id."""
        key = (pending.peer, pending.rid)
        if key in self._by_client:
            raise ValueError(in_flight(pending.rid))
        gid = f"g{next(self._ids)}"
        self._by_gid[gid] = pending
        self._by_client[key] = gid
        self._by_peer.setdefault(pending.peer, set()).add(gid)
        self._by_replica.setdefault(pending.replica, set()).add(gid)
        if pending.kind == "generate":
            self._generating[pending.replica] = self._generating.get(pending.replica, 0) + 1
        return gid

    def get(self, gid: str) -> Pending | None:
        return self._by_gid.get(gid)

    def find(self, peer: bytes, rid: str) -> str | None:
        return self._by_client.get((peer, rid))

    def pop(self, gid: str) -> Pending:
        pending = self._by_gid.pop(gid)
        del self._by_client[(pending.peer, pending.rid)]
        gids = self._by_peer[pending.peer]
        gids.discard(gid)
        if not gids:
            del self._by_peer[pending.peer]
        self._by_replica[pending.replica].discard(gid)
        if pending.kind == "generate":
            self._generating[pending.replica] -= 1
        return pending

    def pop_peer(self, peer: bytes) -> list[tuple[str, Pending]]:
        """Removes and returns every request of a client."""
        return [(gid, self.pop(gid)) for gid in sorted(self._by_peer.get(peer, ()))]

    def pop_replica(self, replica: int) -> list[tuple[str, Pending]]:
        """Removes and returns every request on `replica` (not those spread over several)."""
        return [(gid, self.pop(gid)) for gid in sorted(self._by_replica.get(replica, ()))]

    def spread(self) -> list[tuple[str, Pending]]:
        """The requests spread over several replicas."""
        return [(gid, self._by_gid[gid]) for gid in sorted(self._by_replica.get(-1, ()))]

    def loads(self, replicas: int) -> list[int]:
        """Generate requests in flight on each of `replicas` replicas."""
        return [self._generating.get(i, 0) for i in range(replicas)]

    def pop_all(self) -> list[Pending]:
        return [self.pop(gid) for gid in list(self._by_gid)]
