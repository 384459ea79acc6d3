"""Orders the waiting queue once per step.

- fcfs: arrival order.
- lpm: longest cached prefix first, so shared prefixes are reused before they are evicted;
  plain fcfs when the queue is too long to match every request each step.
- dfs-weight: walks the radix tree depth-first, heaviest subtree (most waiting requests) first,
  so requests that share a prefix run together.
- sjf: shortest remaining work (uncomputed prompt tokens + tokens still to generate) first.
- program: program-level least attained service (as Autellix's PLAS), for requests that carry a
  program context (stemma.program_call; engine.programs keeps each program's record). In order:
  calls that waited longer than program_starvation_s (the age term: no call starves), oldest
  first; then calls that resume a program whose last KV is still cached (a call after a tool
  pause: admitted ahead of new programs, before its KV is evicted); then everything else. Within
  the last two, least attained service first (the tokens computed for the program so far; a
  request with no program has none), then the program's first arrival, so that the calls of one
  program (its forks) are next to each other and are admitted together.
"""
from __future__ import annotations

import time
from collections import defaultdict
from functools import wraps
from typing import Callable, Sequence

from stemma.cache.radix_tree import Node
from stemma.engine.programs import Programs
from stemma.engine.request import Request
from stemma.registry import POLICIES

Matched = tuple[int, Node]  # (cached length, radix node)
MatchFn = Callable[[Request], Matched]
OrderFn = Callable[[list[Request], MatchFn, int], list[Request]]


def order(waiting: Sequence[Request], policy: str, match: MatchFn, fallback_len: int) -> list[Request]:
    reqs = list(waiting)
    if len(reqs) <= 1:
        return reqs
    return POLICIES.get(policy)(reqs, match, fallback_len)


def _matching(rank: Callable[[list[Request], dict[int, Matched]], list[Request]]) -> OrderFn:
    """A policy that ranks by each request's radix-tree match; past `fallback_len` waiting
    requests matching them all every step costs too much, and they keep arrival order."""
    @wraps(rank)
    def ordered(reqs: list[Request], match: MatchFn, fallback_len: int) -> list[Request]:
        if len(reqs) > fallback_len:
            return reqs
        return rank(reqs, {id(r): match(r) for r in reqs})
    return ordered


@POLICIES.register("fcfs")
def _fcfs(reqs: list[Request], match: MatchFn, fallback_len: int) -> list[Request]:
    return reqs


@POLICIES.register("sjf")
def _sjf(reqs: list[Request], match: MatchFn, fallback_len: int) -> list[Request]:
    return sorted(reqs, key=lambda r: (r.extend_len + r.remaining_new_tokens, r.arrival))


@POLICIES.register("lpm")
@_matching
def _lpm(reqs: list[Request], matched: dict[int, Matched]) -> list[Request]:
    return sorted(reqs, key=lambda r: (-matched[id(r)][0], r.arrival))


@POLICIES.register("dfs-weight")
@_matching
def _dfs_weight(reqs: list[Request], matched: dict[int, Matched]) -> list[Request]:
    at_node: dict[int, list[Request]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    nodes: dict[int, Node] = {}
    roots: dict[int, Node] = {}
    for r in reqs:
        node = matched[id(r)][1]
        at_node[id(node)].append(r)
        while node is not None:
            weight[id(node)] += 1
            nodes[id(node)] = node
            if node.parent is None:
                roots[id(node)] = node
            node = node.parent
    out: list[Request] = []
    stack = sorted(roots.values(), key=lambda n: weight[id(n)])
    while stack:
        node = stack.pop()
        out.extend(sorted(at_node.get(id(node), []), key=lambda r: r.arrival))
        children = [c for c in node.children.values() if weight.get(id(c))]
        stack.extend(sorted(children, key=lambda n: weight[id(n)]))
    return out


@POLICIES.register("program")
def _program(reqs: list[Request], match: MatchFn, fallback_len: int) -> list[Request]:
    now = time.perf_counter()
    matching = len(reqs) <= fallback_len  # else no call is known to be resumed

    def key(r: Request) -> tuple:
        rec = r.program
        if rec is None:
            return 2, 0, r.arrival, r.arrival
        if now - r.arrival > rec.starve_after_s:
            return 0, 0, r.arrival, r.arrival
        resumed = matching and rec.last_kv_len > 0 and Programs.resumed(r, match(r)[0])
        return 1 if resumed else 2, rec.attained, rec.first_arrival, r.arrival
    return sorted(reqs, key=key)
