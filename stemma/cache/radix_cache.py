"""The radix cache: the radix tree bound to the slot allocator and the req->slot table.

Ownership of a slot is always exactly one of: free (in the allocator), the tree's, or one
running request's. A running request in row `r` whose radix node is `node` (locked while it runs)
reads the tree's slots at positions `[0, node.depth)` of its row and owns the slots at the
positions after that which it has allocated. So the pool is whole when

    allocator.available + tree.total_size + sum over running requests of
        (positions allocated - node.depth) == allocator.total

which `check_pool_whole` asserts. With the cache disabled, nothing enters the tree, every node is
a root (depth 0), and a request owns its whole row.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from stemma.cache.radix_tree import MatchResult, Node, RadixTree
from stemma.cache.kv_pool import ReqToSlot, SlotAllocator

Tokens = Sequence[int] | torch.Tensor


class RadixCache:
    def __init__(self, allocator: SlotAllocator, req_to_slot: ReqToSlot, enabled: bool = True,
                 rank: Callable[[Node], Any] | None = None):
        """`rank`: the eviction order of unlocked leaves, lowest first (RadixTree.evict); None:
        least recently used first."""
        self.allocator = allocator
        self.req_to_slot = req_to_slot
        self.enabled = enabled
        self.rank = rank
        self.tree = RadixTree(allocator.device)

    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    @property
    def protected_size(self) -> int:
        return self.tree.protected_size

    def match(self, token_ids: Tokens, salt: str | None = None) -> MatchResult:
        """The cached prefix of `token_ids`: its slots and the node ending at it.

        The caller locks the node (`lock`) before anything else can evict, and keeps it locked
        while the request runs. A caller that needs logits at the last prompt token matches all
        but that token. Disabled: no slots, and a root.
        """
        if not self.enabled:
            return self.tree.match_prefix((), salt)
        return self.tree.match_prefix(token_ids, salt)

    def record_hit(self, node: Node, owner: object | None = None) -> None:
        """Counts one request (of `owner`) reusing the cached prefix that ends at `node` (see
        `RadixTree.record_hit`); the engine calls it once per request, at its first admission."""
        self.tree.record_hit(node, owner)

    def lock(self, node: Node) -> None:
        self.tree.inc_lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.dec_lock(node)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots, evicting from the tree if the allocator is short; None if even that is
        not enough (then whatever was evicted stays free)."""
        short = n - self.allocator.available
        if short > 0:
            self.allocator.free(self.tree.evict(short, self.rank))
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        """Returns slots a request owns to the allocator."""
        self.allocator.free(slots)

    # row positions      0 ...... held | held ..... present | present ........ n
    # slots before       tree's         request's: the tree  request's, not yet in the tree
    #                    (matched)      has its own copies
    # what happens       kept           freed; row rewritten  given to the tree
    #                                   to the tree's slots
    # after              tree's ------------------------------------------------ (node.depth == n)
    def cache_unfinished(self, row: int, token_ids: Tokens, salt: str | None,
                         old_node: Node, owner: object | None = None) -> tuple[Node, int]:
        """Caches a running request's first n = len(token_ids) positions, whose KV is computed.

        `old_node` is the request's locked node, so `held = old_node.depth` positions of its row
        already read tree slots. Returns the new locked node and the new tree-held prefix length
        (n; 0 when disabled, where the node stays `old_node`). The request keeps owning the slots
        it allocated past n. `owner` tags the tokens new to the tree (RadixTree.insert).
        """
        if not self.enabled:
            return old_node, 0
        n = len(token_ids)
        held = old_node.depth
        if n < held:
            raise ValueError(f"{n} tokens is shorter than the cached prefix {held}")
        slots = self.req_to_slot.read(row, n)
        present = self.tree.insert(token_ids, slots, salt, owner)
        self.allocator.free(slots[held:present])
        tree_slots, node = self.tree.match_prefix(token_ids, salt)
        self.req_to_slot.write(row, held, tree_slots[held:present])
        self.tree.inc_lock(node)
        self.tree.dec_lock(old_node)
        return node, node.depth

    # row positions   0 .... held | held .... present | present .... num_valid | num_valid .... L
    # slots           tree's       request's            request's                request's, KV never
    #                              duplicates           new to the tree          computed
    # what happens    unlocked     freed                given to the tree        freed
    #                 (L = len(token_ids): the positions of the row that hold slots)
    def cache_finished(self, row: int, token_ids: Tokens, salt: str | None, node: Node,
                       num_valid: int | None = None, owner: object | None = None) -> None:
        """Caches a finished request and gives back everything it held except the row itself.

        Positions `[0, len(token_ids))` of the row hold slots; the first `num_valid` of them
        (default all) have computed KV and are cached, generated tokens included. The slots of
        `[num_valid, len(token_ids))` are freed, as are duplicates of what the tree already had.
        `node` (the request's locked node) is unlocked; `owner` tags the tokens new to the tree.
        The caller frees the row.
        """
        total = len(token_ids)
        num_valid = total if num_valid is None else num_valid
        held = node.depth
        if not held <= num_valid <= total:
            raise ValueError(f"need node depth {held} <= num_valid {num_valid} <= {total} tokens")
        slots = self.req_to_slot.read(row, total)
        if self.enabled:
            present = self.tree.insert(token_ids[:num_valid], slots[:num_valid], salt, owner)
            self.allocator.free(torch.cat([slots[held:present], slots[num_valid:]]))
        else:
            self.allocator.free(slots[held:])
        self.tree.dec_lock(node)

    def flush(self) -> bool:
        """Drops the whole tree and frees its slots; refuses (False) while any node is locked."""
        if self.tree.protected_size:
            return False
        self.allocator.free(self.tree.evict(self.tree.total_size))
        self.tree.reset()
        return True

    def usage(self) -> dict[str, int | float]:
        """The pool's slots: total, free, held by the tree, the share not free (`pool_usage`),
        and the share that running requests hold, the tree's evictable slots counted as free
        (`kv_usage`: vLLM's kv_cache_usage_perc, SGLang's token_usage)."""
        alloc = self.allocator
        return {"pool_total": alloc.total, "pool_free": alloc.available,
                "pool_cached": self.tree.total_size, "pool_usage": 1.0 - alloc.available / alloc.total,
                "kv_usage": 1.0 - (alloc.available + self.tree.evictable_size) / alloc.total}

    def check_pool_whole(self, held_by_requests: int) -> None:
        """Asserts free + tree-held + held_by_requests == total, where `held_by_requests` counts
        the slots running requests own (not the tree's slots they read)."""
        free, cached = self.allocator.available, self.tree.total_size
        if free + cached + held_by_requests != self.allocator.total:
            raise AssertionError(f"pool not whole: free {free} + tree {cached} + requests "
                                 f"{held_by_requests} != total {self.allocator.total}")
