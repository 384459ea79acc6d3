"""Radix matches of waiting requests, made once per step and shared by the policy, the in-batch
prefix check and admission."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stemma.cache.radix_cache import RadixCache
    from stemma.cache.radix_tree import MatchResult, Node
    from stemma.engine.request import Request


def match_cap(req: Request) -> int:
    """How many of req's tokens may come from the cache: all but the last (whose logits the step
    needs), and none from where its prompt logprobs start."""
    cap = len(req.tokens) - 1
    start = req.logit_start()
    return cap if start is None else min(cap, start)


class PrefixMatches:
    """`get(req)` matches req's cacheable tokens once and remembers the result while the tree's
    version stands (an insert or an eviction in between makes the next `get` match again), so
    what it returns is always what a fresh match would return."""

    def __init__(self, cache: RadixCache):
        self.cache = cache
        self._memo: dict[int, tuple[int, MatchResult]] = {}  # id(req) -> (tree version, match)

    def clear(self) -> None:
        """Called at the start of each step."""
        self._memo.clear()

    def get(self, req: Request) -> MatchResult:
        version = self.cache.tree.version
        hit = self._memo.get(id(req))
        if hit is not None and hit[0] == version:
            return hit[1]
        match = self.cache.match(req.tokens[:match_cap(req)], req.salt)
        self._memo[id(req)] = (self.cache.tree.version, match)
        return match

    def length_and_node(self, req: Request) -> tuple[int, Node]:
        slots, node = self.get(req)
        return len(slots), node
