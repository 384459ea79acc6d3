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
from typing import Callable, Sequence

from stemma.engine.request import Request

MatchFn = Callable[[Request], tuple[int, object]]  # request -> (cached length, radix node)


def order(waiting: Sequence[Request], policy: str, match: MatchFn, fallback_len: int) -> list[Request]:
    reqs = list(waiting)
    if policy == "fcfs" or len(reqs) <= 1:
        return reqs
    if policy == "sjf":
        return sorted(reqs, key=lambda r: (r.extend_len + r.remaining_new_tokens, r.arrival))
    if len(reqs) > fallback_len:
        return reqs
    matched = {id(r): match(r) for r in reqs}
    if policy == "lpm":
        return sorted(reqs, key=lambda r: (-matched[id(r)][0], r.arrival))
    return _dfs_weight(reqs, matched)


def _dfs_weight(reqs: list[Request], matched: dict) -> list[Request]:
    at_node: dict[int, list[Request]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    nodes = {}
    roots = {}
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
