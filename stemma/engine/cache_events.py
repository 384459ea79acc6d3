"""The engine's radix-tree changes, queued as CacheEvents for the gateway's cache-aware router.

Attached to a tree, it first describes what the tree already holds (a clear, then every leaf's
path), then hears each change as the tree makes it (RadixTree.listener). `take()` hands over
what has queued since the last call, in order, as one message; the engine process sends it with
the step's other output, so the router's mirror follows the tree step by step.
"""
from __future__ import annotations

from stemma import protocol as P
from stemma.cache.radix_tree import RadixTree


class CacheEventLog:
    def __init__(self, tree: RadixTree):
        self.events: list[list[int]] = []
        self.salts: dict[str, int] = {}
        self.cleared()
        for node in tree.nodes():
            if not node.children:
                self.stored(tree.path_key(node), node.salt)
        tree.listener = self

    def stored(self, key, salt: str | None) -> None:
        self.events.append([P.CacheEvents.STORE, 0, self._salt(salt), *key])

    def removed(self, key, keep: int, salt: str | None) -> None:
        self.events.append([P.CacheEvents.REMOVE, keep, self._salt(salt), *key])

    def cleared(self) -> None:
        self.events.append([P.CacheEvents.CLEAR, 0, -1])

    def take(self) -> P.CacheEvents | None:
        if not self.events:
            return None
        msg = P.CacheEvents(events=self.events, salts=list(self.salts))
        self.events, self.salts = [], {}
        return msg

    def _salt(self, salt: str | None) -> int:
        if salt is None:
            return -1
        return self.salts.setdefault(salt, len(self.salts))
