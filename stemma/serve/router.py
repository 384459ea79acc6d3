"""Which replica serves a request, when the gateway runs several (`stemma serve --dp N`).

    cache_aware   the replica that holds the longest prefix of the prompt, unless the loads are
                  out of balance (then the least loaded); a program's calls stay on one replica
    round_robin   each request to the next serving replica in turn
    least_load    the serving replica with the fewest requests in flight

`cache_aware` keeps a PrefixIndex per replica. With `cache_tree="exact"` it is the replica's own
radix tree, rebuilt from the insert and evict events the replica publishes (CacheEvents), with
the prompts routed there in the last FLIGHT_S seconds or so over it (a prompt is in the cache
only once its prefill has run and its event come back: a burst sharing a prefix went by load);
with "approximate" it is the prompts routed there, bounded by `approx_max_tokens` (least recently
used go first), as SGLang's router keeps it. The router keeps the approximate tree in both modes
and, while events flow, counts how the two would differ (`stats()["tree"]`).

The loads are out of balance when the busiest serving replica has more than `balance_abs`
requests in flight beyond the least busy AND more than `balance_rel` times as many.
Invariant: `choose` only ever names a serving replica.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from stemma.field_doc import doc, one_of
from stemma.protocol import CacheEvents
from stemma.serve.prefix_index import PrefixIndex

POLICIES = ("cache_aware", "round_robin", "least_load")
TREES = ("exact", "approximate")
MAX_PROGRAMS = 1 << 16  # programs pinned at once (one that never ends is forgotten, oldest first)
FLIGHT_S = 2.0  # the exact tree counts a routed prompt as its replica's for about 2-4 s: until its
                # prefill's insert event has come back (a burst sharing a prefix then goes
                # where the first went, as SGLang's tree, which inserts as it routes, sends it)


@dataclass(frozen=True)
class Routing:
    """How the gateway spreads requests over its replicas (with --dp above 1)."""
    router: str = one_of("cache_aware", POLICIES, "how requests are spread over the replicas "
                                                  "(with --dp above 1)")
    cache_tree: str = one_of("exact", TREES, "cache_aware's view of each replica's cache: 'exact' "
                                             "from the replica's insert and evict events, "
                                             "'approximate' from the prompts routed to it")
    cache_threshold: float = doc(0.3, "cache_aware: the matched share of a prompt from which the "
                                      "replica holding it is chosen over the least loaded one")
    balance_abs: int = doc(16, "cache_aware: requests in flight by which the busiest replica must "
                               "exceed the least busy one (and --balance-rel) to route by load")
    balance_rel: float = doc(1.5, "cache_aware: the ratio of in-flight requests, busiest to least "
                                  "busy, past which (with --balance-abs) it routes by load")
    approx_max_tokens: int = doc(1 << 22, "cache_aware: the approximate tree's size per replica "
                                          "in tokens (least recently used prompts go first)")

    def __post_init__(self):
        if self.router not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {self.router!r}")
        if self.cache_tree not in TREES:
            raise ValueError(f"cache_tree must be one of {', '.join(TREES)}, got {self.cache_tree!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if not self.balance_rel >= 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")
        if self.approx_max_tokens < 1:
            raise ValueError(f"approx_max_tokens must be >= 1, got {self.approx_max_tokens}")


class Router:
    def __init__(self, replicas: int, routing: Routing, clock: Callable[[], float] = time.monotonic):
        self.routing = routing
        self.exact = [PrefixIndex() for _ in range(replicas)]
        self.approx = [PrefixIndex() for _ in range(replicas)]
        # the prompts routed to each replica in this FLIGHT_S period and the one before
        self.flight = [(PrefixIndex(), PrefixIndex()) for _ in range(replicas)]
        self.clock = clock
        self._period = clock()
        self.events = [False] * replicas       # whether replica i's exact tree is fed
        self.programs: dict[str, int] = {}     # program id -> the replica its calls go to
        self._turn = itertools.count()
        self.routed = [0] * replicas
        self.reasons: dict[str, int] = {}
        self.tree = {"prompt_tokens": 0, "exact_matched": 0, "approx_matched": 0,
                     "approx_over": 0, "approx_under": 0, "choice_differs": 0, "compared": 0}

    def choose(self, ids: Sequence[int], salt: str | None, program: str | None,
               loads: Sequence[int], serving: Sequence[bool]) -> int:
        """The replica for a prompt `ids` (`loads`: requests in flight per replica). Raises
        ValueError when none serves."""
        alive = [i for i, ok in enumerate(serving) if ok]
        if not alive:
            raise ValueError("no replica is serving")
        if self.routing.router == "cache_aware":
            self._rotate()
        index, reason = self._choose(ids, salt, program, loads, alive)
        self.routed[index] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        # only cache_aware keeps a program on its replica; under the others a program's calls
        # spread, so its end goes to every replica (end_program: None)
        if program is not None and self.routing.router == "cache_aware":
            self.programs.pop(program, None)  # re-inserted: the dict is oldest first
            self.programs[program] = index
            if len(self.programs) > MAX_PROGRAMS:
                del self.programs[next(iter(self.programs))]
        if self.routing.router == "cache_aware":  # only cache_aware reads (or compares) them
            self.flight[index][0].store(ids, salt)
            self.approx[index].store(ids, salt)
            self.approx[index].evict_lru(self.routing.approx_max_tokens)
        return index

    def _choose(self, ids, salt, program, loads, alive) -> tuple[int, str]:
        policy = self.routing.router
        if policy == "round_robin":
            return alive[next(self._turn) % len(alive)], "round_robin"
        least = min(alive, key=lambda i: (loads[i], i))
        if policy == "least_load":
            return least, "least_load"
        pinned = self.programs.get(program) if program is not None else None
        if pinned in alive:
            return pinned, "program"
        low, high = loads[least], max(loads[i] for i in alive)
        if high - low > self.routing.balance_abs and high > self.routing.balance_rel * low:
            return least, "balance"
        trees = self.exact if self.routing.cache_tree == "exact" else self.approx
        matched = {i: trees[i].match(ids, salt, touch=True) for i in alive}
        self._compare(ids, salt, alive, loads, matched)
        if self.routing.cache_tree == "exact":  # and what is on its way into each cache
            matched = {i: max(m, *(f.match(ids, salt) for f in self.flight[i])) for i, m in matched.items()}
        best = max(matched.values())
        if best and best >= self.routing.cache_threshold * len(ids):
            return min((i for i in alive if matched[i] == best), key=lambda i: (loads[i], i)), "cache"
        return min(alive, key=lambda i: (loads[i], trees[i].size, i)), "load"

    def _compare(self, ids, salt, alive, loads, matched) -> None:
        """Counts how the approximate tree's view differs from the exact one (events flowing)."""
        if not all(self.events[i] for i in alive):
            return
        exact = matched if self.routing.cache_tree == "exact" else \
            {i: self.exact[i].match(ids, salt) for i in alive}
        approx = matched if self.routing.cache_tree == "approximate" else \
            {i: self.approx[i].match(ids, salt) for i in alive}
        t = self.tree
        t["compared"] += 1
        t["prompt_tokens"] += len(ids) * len(alive)
        for i in alive:
            t["exact_matched"] += exact[i]
            t["approx_matched"] += approx[i]
            t["approx_over"] += max(0, approx[i] - exact[i])
            t["approx_under"] += max(0, exact[i] - approx[i])
        pick = {name: min(alive, key=lambda i: (-view[i], loads[i], i))
                for name, view in (("exact", exact), ("approx", approx))}
        t["choice_differs"] += pick["exact"] != pick["approx"]

    def on_events(self, replica: int, events: list[list[int]], salts: list[str]) -> None:
        """A replica's cache events, in order: [op, keep, salt index (-1: none), *tokens]."""
        self.events[replica] = True
        tree = self.exact[replica]
        for event in events:
            op, keep, salt_at, tokens = event[0], event[1], event[2], event[3:]
            salt = salts[salt_at] if salt_at >= 0 else None
            if op == CacheEvents.STORE:
                tree.store(tokens, salt)
            elif op == CacheEvents.REMOVE:
                tree.truncate(tokens, keep, salt)
            elif op == CacheEvents.CLEAR:
                tree.clear()
                self.flight[replica] = (PrefixIndex(), PrefixIndex())

    def end_program(self, program: str) -> int | None:
        """Forgets where program `program` ran; returns that replica (None if unknown)."""
        return self.programs.pop(program, None)

    def reset(self, replica: int) -> None:
        """Replica `replica` is gone (or restarted empty): nothing is cached there, and its
        programs go elsewhere."""
        self.exact[replica].clear()
        self.approx[replica].clear()
        self.flight[replica] = (PrefixIndex(), PrefixIndex())
        self.events[replica] = False
        for program in [p for p, i in self.programs.items() if i == replica]:
            del self.programs[program]

    def _rotate(self) -> None:
        """Starts a new FLIGHT_S period when one has passed: the period before it is forgotten."""
        now = self.clock()
        if now - self._period >= 2 * FLIGHT_S:  # both periods are over
            self.flight = [(PrefixIndex(), PrefixIndex()) for _ in self.flight]
            self._period = now
        elif now - self._period >= FLIGHT_S:
            self.flight = [(PrefixIndex(), current) for current, _ in self.flight]
            self._period = now

    def stats(self) -> dict:
        return {"policy": self.routing.router, "cache_tree": self.routing.cache_tree,
                "routed": list(self.routed), "reasons": dict(self.reasons),
                "tree_tokens": {"exact": [t.size for t in self.exact],
                                "approx": [t.size for t in self.approx]},
                "tree": dict(self.tree), "programs": len(self.programs)}
