"""The router's view of one replica's cache: a radix tree over token ids, with no KV behind it.

It answers one question, "how many leading tokens of this prompt does the replica hold?", and is
fed one of two ways (see serve.router):
- exactly, from the replica's own cache events: every insert (`store`) and every evicted leaf
  (`truncate`) of its radix tree, in order, so the set of prefixes here is the replica's;
- approximately, from what the router sent there (`store` of each prompt it routes), bounded by
  `evict_lru`, as SGLang's router does: the replica may have evicted what is still here, or
  cached output tokens this never saw.

Invariants: a path from a root spells a stored prefix; every non-root node has a non-empty key
and sits in `parent.children[key[0]]`; `size` is the number of tokens over all nodes; each salt
has its own root (the None salt's always exists), as in the engine's tree.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from stemma.token_keys import common_len


class _Node:
    __slots__ = ("key", "parent", "children", "last")

    def __init__(self, key: tuple[int, ...], parent: "_Node | None"):
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last = 0


class PrefixIndex:
    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._roots: dict[str | None, _Node] = {None: _Node((), None)}
        self._clock = itertools.count(1)
        self.size = 0

    def match(self, ids: Sequence[int], salt: str | None = None, touch: bool = False) -> int:
        """The length of the longest stored prefix of `ids` (`touch`: its nodes become the most
        recently used)."""
        node = self._roots.get(salt)
        i = 0
        while node is not None and i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            p = common_len(child.key, ids, i)
            i += p
            if touch:
                child.last = next(self._clock)
            if p < len(child.key):
                break
            node = child
        return i

    def store(self, ids: Sequence[int], salt: str | None = None) -> int:
        """Stores `ids` and all its prefixes; returns how many of its tokens were new."""
        ids = tuple(ids)
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = _Node((), None)
        i, now = 0, next(self._clock)
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(ids[i:], node)
                leaf.last = now
                node.children[ids[i]] = leaf
                self.size += len(leaf.key)
                return len(leaf.key)
            p = common_len(child.key, ids, i)
            if p < len(child.key):
                child = self._split(child, p)
            child.last = now
            node, i = child, i + p
        return 0

    def truncate(self, ids: Sequence[int], keep: int, salt: str | None = None) -> int:
        """Forgets every stored prefix longer than `keep` tokens that starts with
        `ids[:keep + 1]` (a replica evicted the leaf that spelled `ids[keep:]`, and all below it);
        returns the tokens removed."""
        if keep >= len(ids):
            return 0
        ids = tuple(ids[:keep + 1])
        node, depth = self._roots.get(salt), 0
        while node is not None:
            child = node.children.get(ids[depth])
            if child is None:
                return 0
            p = common_len(child.key, ids, depth)
            if depth + len(child.key) <= keep:
                if p < len(child.key):
                    return 0
                node, depth = child, depth + len(child.key)
                continue
            if p < keep + 1 - depth:
                return 0
            if keep > depth:
                self._split(child, keep - depth)  # `child` stays the lower part
            return self._drop(child)
        return 0

    def evict_lru(self, max_tokens: int) -> int:
        """Drops least recently used leaves until at most `max_tokens` are stored; returns the
        tokens dropped."""
        if self.size <= max_tokens:
            return 0
        tie = itertools.count()
        heap = [(n.last, next(tie), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        dropped = 0
        while heap and self.size > max_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            dropped += self._drop(leaf)
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.last, next(tie), parent))
        return dropped

    def prefixes(self, salt: str | None = None) -> set[tuple[int, ...]]:
        """Every stored path ending (the token paths of all leaves), for tests."""
        out = set()
        stack = [(self._roots[salt], ())] if salt in self._roots else []
        while stack:
            node, path = stack.pop()
            path = path + node.key
            if not node.children and node.parent is not None:
                out.add(path)
            stack.extend((c, path) for c in node.children.values())
        return out

    def _nodes(self):
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts `node`'s key after `at` tokens; returns the new upper part (node stays below)."""
        upper = _Node(node.key[:at], node.parent)
        upper.last = node.last
        node.parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[at:], upper
        upper.children[node.key[0]] = node
        return upper

    def _drop(self, node: _Node) -> int:
        """Removes `node` and everything below it; returns their tokens. Drops a salted root
        left empty."""
        parent = node.parent
        del parent.children[node.key[0]]
        gone, stack = 0, [node]
        while stack:
            n = stack.pop()
            gone += len(n.key)
            stack.extend(n.children.values())
        self.size -= gone
        if parent.parent is None and not parent.children:
            for salt, root in list(self._roots.items()):
                if root is parent and salt is not None:
                    del self._roots[salt]
        return gone
