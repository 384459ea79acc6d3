"""A radix tree from token prefixes to KV slots: match, insert, split, lock, evict.

Keys are token-id sequences and values are the KV slots of those tokens, one slot per token
(page size 1). Each edge (a `Node`) holds a run of tokens and their slots. A path from a root
spells a cached prefix, and the slots along it are that prefix's KV.

An optional cache salt namespaces keys. Each salt has its own root, so sequences under
different salts never share a node. The `None` salt's root always exists. A salted root is made
by the first insert under that salt and dropped when eviction empties it.

Invariants (see `check_invariants`):
- every slot in the tree appears exactly once, and `total_size` is the number of them;
- `lock_ref` counts locks held at a node or below it (locks are walked to the root), so a
  node is locked iff some lock's path passes through it;
- `evictable_size` counts the tokens of unlocked nodes and `protected_size` those of locked ones;
- eviction removes unlocked leaves only, least recently used first (or in the order of the
  caller's rank), so a locked node and its ancestors stay in the tree;
- `hits` counts the `record_hit` calls at a node or below it: the caller records one per request
  whose cached prefix (at its first admission) passed through the node, i.e. the requests that
  reused its KV. `match_prefix` counts nothing, as it also serves the cache's own bookkeeping.
  A hit is walked to the root, so a node never has more hits than its parent.

`version` changes whenever an insert adds tokens or an eviction removes some, so a match made at
one version is still exact while the version stands (a split changes no match: it keeps depths).

`listener`, when set, hears every change to the set of cached prefixes, in order:
`stored(key, salt)` after an insert adds tokens, `removed(key, keep, salt)` before a leaf spelling
`key` (below depth `keep`) is evicted, and `cleared()` on reset; a replica behind a cache-aware
router mirrors its tree from them (serve.router).

The tree never frees slots itself: `evict` returns them, and `insert` tells the caller how long
a prefix was already present, whose slots the caller then frees.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from stemma.token_keys import Key, common_len

_VERSIONS = itertools.count(1)  # `RadixTree.version` values, never reused by any tree


def as_key(tokens: Sequence[int] | torch.Tensor) -> Key:
    """Token ids as a tuple of ints (a tensor is read to the host)."""
    if isinstance(tokens, torch.Tensor):
        return tuple(tokens.tolist())
    return tuple(int(t) for t in tokens)


class Node:
    """One edge of the tree: the tokens `key`, their slots `value`, hanging below `parent`.

    A root has no parent and an empty key. Any other node has `len(key) == len(value) > 0`, sits
    in `parent.children[key[0]]`, and has `depth == parent.depth + len(key)`. The depth of a node
    never changes, because a split puts the new node above the one it splits.
    """

    __slots__ = ("key", "value", "parent", "children", "salt", "depth", "lock_ref", "last_access",
                 "hits", "owner")

    def __init__(self, key: Key, value: torch.Tensor, parent: Node | None, salt: str | None):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.salt = salt
        self.depth = len(key) + (parent.depth if parent is not None else 0)
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        self.owner: object | None = None  # who inserted its tokens (a program record), for ranks

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return (f"Node(key={list(self.key)}, depth={self.depth}, lock_ref={self.lock_ref}, "
                f"salt={self.salt!r})")


class MatchResult(NamedTuple):
    """The slots of the longest cached prefix and the node that ends exactly at it.

    `len(slots) == node.depth`. With no match, `slots` is empty and `node` is a root.
    """
    slots: torch.Tensor
    node: Node


class RadixTree:
    """Token prefixes -> KV slots, with lock refs and LRU eviction. See the module docstring."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.listener: Any = None
        self.reset()

    def reset(self) -> None:
        """Forgets everything, locks included. The caller frees the slots first if it owns them."""
        self._roots: dict[str | None, Node] = {None: self._new_root(None)}
        self._clock = itertools.count(1)
        self._evictable = 0
        self._protected = 0
        self.version = next(_VERSIONS)
        if self.listener is not None:
            self.listener.cleared()

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    @property
    def total_size(self) -> int:
        """Slots held by the tree, each counted once."""
        return self._evictable + self._protected

    def match_prefix(self, key: Sequence[int] | torch.Tensor, salt: str | None = None) -> MatchResult:
        """The longest cached prefix of `key` under `salt`.

        If the match ends inside an edge, that edge is split so the returned node ends exactly at
        the match. Every node on the path becomes the most recently used (no hit is counted: see
        `record_hit`). The node is valid until it is evicted, so a caller that keeps it locks it
        before anything can evict.
        """
        root = self._roots.get(salt)
        if root is None:
            return MatchResult(self._empty(), self._new_root(salt))
        node, _ = self._walk(root, as_key(key))
        return MatchResult(self.path_slots(node), node)

    def insert(self, key: Sequence[int] | torch.Tensor, slots: torch.Tensor,
               salt: str | None = None, owner: object | None = None) -> int:
        """Caches `key` with `slots` (one per token); returns the length already present.

        The tree keeps its own slots for the already-present prefix `key[:returned]`, so
        `slots[:returned]` are not taken: the caller frees those it owns. `slots[returned:]` now
        belong to the tree, in a new unlocked leaf whose `owner` is `owner`.
        """
        key = as_key(key)
        if slots.numel() != len(key):
            raise ValueError(f"{len(key)} tokens but {slots.numel()} slots")
        if not key:
            return 0
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self._new_root(salt)
        node, present = self._walk(root, key)
        if present < len(key):
            leaf = Node(key[present:], slots[present:].to(self.device, torch.int64).clone(), node, salt)
            node.children[leaf.key[0]] = leaf
            leaf.last_access = next(self._clock)
            leaf.owner = owner
            self._evictable += len(leaf.key)
            self.version = next(_VERSIONS)
            if self.listener is not None:
                self.listener.stored(key, salt)
        return present

    def record_hit(self, node: Node, owner: object | None = None) -> None:
        """Counts one hit on `node` and each of its ancestors below the root: one request reused
        the prefix that ends at `node`. A root counts nothing. A node on the path whose owner is
        not the request's `owner` is shared from now on: its owner becomes None."""
        while not node.is_root:
            node.hits += 1
            if node.owner is not owner:
                node.owner = None
            node = node.parent

    def inc_lock(self, node: Node) -> None:
        """Protects `node` and its ancestors from eviction. Locking a root does nothing."""
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: Node) -> None:
        """Releases one `inc_lock(node)`."""
        if not node.is_root and node.lock_ref == 0:
            raise RuntimeError(f"dec_lock on an unlocked node: {node!r}")
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    def evict(self, num_tokens: int, rank: Callable[[Node], Any] | None = None) -> torch.Tensor:
        """Removes unlocked leaves, least recently used first (lowest `rank(leaf)` first when
        given), until at least `num_tokens` slots are freed or nothing unlocked is left; returns
        the freed slots (the caller frees them).

        A parent whose last child goes becomes a leaf and a candidate in turn.
        """
        rank = rank or _last_access
        tie = itertools.count()
        heap = [(rank(n), next(tie), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while heap and count < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = self._remove_leaf(leaf)
            freed.append(leaf.value)
            count += len(leaf.key)
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (rank(parent), next(tie), parent))
        if freed:
            self.version = next(_VERSIONS)
        return torch.cat(freed) if freed else self._empty()

    def path_slots(self, node: Node) -> torch.Tensor:
        """The slots from the root down to the end of `node` (`node.depth` of them)."""
        parts = []
        while not node.is_root:
            parts.append(node.value)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else self._empty()

    def continuation(self, key: Sequence[int], salt: str | None, k: int) -> list[int]:
        """Up to k cached tokens that follow `key` under `salt`, when all of `key` is cached:
        the rest of the edge it ends in, then down the children most hit (then most recently
        used). Read-only: no split, no access time, so a lookup changes no eviction order."""
        root = self._roots.get(salt)
        if root is None or k <= 0:
            return []
        key = key if isinstance(key, tuple) else tuple(key)
        node, i, out = root, 0, []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                return []
            p = common_len(child.key, key, i)
            if p < len(child.key):
                if i + p < len(key):
                    return []  # the key leaves the tree inside this edge
                out = list(child.key[p:p + k])
            node, i = child, i + p
        while len(out) < k and node.children:
            node = max(node.children.values(), key=lambda c: (c.hits, c.last_access))
            out.extend(node.key[:k - len(out)])
        return out

    def path_key(self, node: Node) -> Key:
        """The tokens from the root down to the end of `node`."""
        parts = []
        while not node.is_root:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def roots(self) -> dict[str | None, Node]:
        """A copy of the salt -> root map."""
        return dict(self._roots)

    def nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Raises AssertionError if the tree's structure or size counters are inconsistent."""
        evictable = protected = 0
        seen: set[int] = set()
        for salt, root in self._roots.items():
            _require(root.is_root and root.salt == salt and not root.key, f"bad root for {salt!r}")
            _require(salt is None or root.children, f"empty salted root {salt!r} was kept")
        for node in self.nodes():
            parent = node.parent
            _require(len(node.key) == node.value.numel() > 0, f"key/value mismatch at {node!r}")
            _require(parent.children.get(node.key[0]) is node, f"{node!r} is not its parent's child")
            _require(node.salt == parent.salt, f"{node!r} crosses salts")
            _require(node.depth == parent.depth + len(node.key), f"wrong depth at {node!r}")
            _require(node.lock_ref >= 0, f"negative lock_ref at {node!r}")
            _require(parent.is_root or parent.lock_ref >= node.lock_ref, f"lock not walked up from {node!r}")
            _require(parent.is_root or parent.hits >= node.hits, f"more hits than its parent at {node!r}")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            slots = node.value.tolist()
            _require(seen.isdisjoint(slots) and len(set(slots)) == len(slots), f"slot held twice at {node!r}")
            seen.update(slots)
        _require(evictable == self._evictable, f"evictable_size {self._evictable} != {evictable}")
        _require(protected == self._protected, f"protected_size {self._protected} != {protected}")

    def pretty(self) -> str:
        """A readable dump, one node per line."""
        lines = []
        for salt, root in self._roots.items():
            lines.append(f"root salt={salt!r}")
            stack = [(c, 1) for c in reversed(list(root.children.values()))]
            while stack:
                node, indent = stack.pop()
                lines.append(f"{'  ' * indent}{list(node.key)} -> {node.value.tolist()} "
                             f"lock={node.lock_ref} hits={node.hits} t={node.last_access}")
                stack.extend((c, indent + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)

    def _walk(self, node: Node, key: Key) -> tuple[Node, int]:
        """Follows `key` down from `node`, splitting the edge where the match ends inside one and
        touching each node passed. Returns the last node and the matched length (its depth)."""
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            p = common_len(child.key, key, i)
            if p < len(child.key):
                child = self._split(child, p)
            node = child
            node.last_access = next(self._clock)
            i += p
        return node, i

    def _split(self, node: Node, at: int) -> Node:
        """Splits `node`'s edge after `at` tokens; returns the new upper node.

        `node` keeps its identity (and depth) as the lower part, so callers holding it still hold
        the same prefix. The upper part inherits the lock count and the hit count: every lock and
        every recorded hit through `node` passes through it, and its owner: the tokens were inserted
        together (a request of another owner that reuses them makes them shared: record_hit).
        """
        parent = node.parent
        upper = Node(node.key[:at], node.value[:at], parent, node.salt)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hits = node.hits
        upper.owner = node.owner
        parent.children[upper.key[0]] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[node.key[0]] = node
        return upper

    def _remove_leaf(self, leaf: Node) -> Node:
        """Detaches an unlocked leaf; returns its parent. Drops a salted root left empty."""
        parent = leaf.parent
        if self.listener is not None:
            self.listener.removed(self.path_key(leaf), parent.depth, leaf.salt)
        del parent.children[leaf.key[0]]
        self._evictable -= len(leaf.key)
        if parent.is_root and parent.salt is not None and not parent.children:
            del self._roots[parent.salt]
        return parent

    def _new_root(self, salt: str | None) -> Node:
        return Node((), self._empty(), None, salt)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)


def _last_access(node: Node) -> int:
    return node.last_access


def _require(condition: object, message: str) -> None:
    if not condition:
        raise AssertionError(message)
