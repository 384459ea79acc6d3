"""What the dashboard shows of an engine: its radix tree's biggest subtrees and its requests
(the `CacheTree` reply to `GetCacheTree`).

Built in the engine loop between steps, once a second while a dashboard polls, so it costs one
pass over the tree's nodes and the scheduler's queues and allocates nothing per token.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stemma.cache.radix_tree import Node, RadixTree
    from stemma.engine.engine import Engine
    from stemma.engine.request import Request

EDGE_TOKENS = 64     # token ids sent of a node's own edge: its first ones
MAX_REQUESTS = 1000  # requests listed at most, running ones first

NodeDict = dict[str, Any]
RequestDict = dict[str, Any]


def cache_tree(engine: Engine, limit: int) -> tuple[list[NodeDict], list[RequestDict]]:
    """The `limit` biggest subtrees of the engine's radix tree and its requests.

    Nodes: the `limit` nodes with the most tokens in their subtree, as dicts {id, parent, tokens,
    depth, size, hits, locks}; `tokens` holds the first EDGE_TOKENS ids of the node's own edge
    (fewer than `depth - depth of the parent` when it is longer); `hits` is the number of requests
    whose cached prefix at first admission passed through the node (that reused its KV), and
    `locks` the number of running requests on it or below it. Ids are positions in the list.
    A parent's subtree always holds more tokens than any child's (its own edge is never empty),
    so every listed node's parent is listed too, unless it is a root: `parent` is None exactly
    for the children of a root. The list is the forest in preorder, siblings biggest first.

    Requests: see `request_dicts`.
    """
    return node_dicts(engine.cache.tree, limit), request_dicts(engine)


def subtree_sizes(tree: RadixTree) -> dict[Node, int]:
    """Tokens in each non-root node's subtree, itself included."""
    order = list(tree.nodes())  # parents before children
    size = {node: len(node.key) for node in order}
    for node in reversed(order):  # children before parents: a child's size is final here
        if not node.parent.is_root:
            size[node.parent] += size[node]
    return size


def node_dicts(tree: RadixTree, limit: int) -> list[NodeDict]:
    """The `limit` biggest subtrees of `tree` (see `cache_tree`)."""
    size = subtree_sizes(tree)
    chosen = set(heapq.nlargest(limit, size, key=size.__getitem__))  # closed upward to the roots

    def by_size(nodes):
        return sorted(nodes, key=size.__getitem__, reverse=True)

    ids: dict[Node, int] = {}
    out: list[NodeDict] = []
    stack = by_size(n for n in chosen if n.parent.is_root)[::-1]
    while stack:
        node = stack.pop()
        ids[node] = len(out)
        out.append({"id": ids[node], "parent": ids.get(node.parent), "tokens": list(node.key[:EDGE_TOKENS]),
                    "depth": node.depth, "size": size[node], "hits": node.hits, "locks": node.lock_ref})
        stack.extend(by_size(c for c in node.children.values() if c in chosen)[::-1])
    return out


def request_dicts(engine: Engine) -> list[RequestDict]:
    """The scheduler's requests, running, then waiting, then in the grammar queue (at most
    MAX_REQUESTS in all), as dicts {rid (the engine-side id), state ("running", "waiting" or
    "grammar"), prompt_tokens, output_tokens, cached_tokens (prompt tokens the cache served at
    first admission)}."""
    sched = engine.scheduler
    groups = (("running", sched.running), ("waiting", sched.waiting),
              ("grammar", [req for req, _ in sched.grammar_queue]))
    out: list[RequestDict] = []
    for state, reqs in groups:
        for req in reqs:
            if len(out) == MAX_REQUESTS:
                return out
            out.append(_request_dict(req, state))
    return out


def _request_dict(req: Request, state: str) -> RequestDict:
    return {"rid": req.rid, "state": state, "prompt_tokens": len(req.input_ids),
            "output_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens}
