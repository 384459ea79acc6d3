"""Orders the waiting queue once per step.

- fcfs: arrival order.
- lpm: longest cached prefix first, so shared prefixes are reused before they are evicted;
  plain fcfs when the queue is too long to match every request each step.
- dfs-weight: walks the radix tree depth-first, heaviest subtree (most waiting requests) first,
  so requests that share a prefix run together.
- sjf: shortest remaining work (uncomputed prompt tokens + tokens still to generate) first.
"""
from __future__ import annotations

from collections import defaultdict
from functools import wraps
from typing import Callable, Sequence

from stemma.cache.radix_tree import Node
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
