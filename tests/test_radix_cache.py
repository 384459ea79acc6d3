"""The radix cache over a real SlotAllocator and ReqToSlot, with simulated requests.

A fake KV store maps each slot to the (salt, prefix) whose last token's KV it holds; a slot's
entry is dropped as soon as the slot is free. So a request that reads a freed, reused or wrong
slot shows up as a mismatch between its row and its own tokens.
"""
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from stemma.cache.radix_cache import RadixCache
from stemma.cache.radix_tree import Node
from stemma.cache.kv_pool import ReqToSlot, SlotAllocator

TOTAL_SLOTS, MAX_REQS, MAX_CONTEXT, MAX_TOKENS = 16, 4, 32, 14


@dataclass
class Req:
    row: int
    salt: str | None
    prompt_len: int
    tokens: list[int]
    node: Node
    computed: int      # positions [0, computed) have KV
    allocated: int     # positions [0, allocated) hold slots; the request owns [node.depth, allocated)
    kv: dict = field(default_factory=dict)
    owner: object = None  # what tags the tokens it adds to the tree (a program record)

    @property
    def owned(self) -> int:
        return self.allocated - self.node.depth


class Sim:
    """Drives a RadixCache the way a scheduler would and checks it after every step."""

    def __init__(self, enabled=True, total=TOTAL_SLOTS, rank=None):
        self.allocator = SlotAllocator(total)
        self.table = ReqToSlot(MAX_REQS, MAX_CONTEXT)
        self.cache = RadixCache(self.allocator, self.table, enabled=enabled, rank=rank)
        self.reqs: list[Req] = []
        self.kv: dict[int, tuple] = {}   # slot -> (salt, prefix) whose last token's KV it holds

    def start(self, tokens, salt=None) -> Req:
        slots, node = self.cache.match(tokens[:-1], salt)
        self.cache.lock(node)
        row = self.table.alloc_row()
        self.table.write(row, 0, slots)
        req = Req(row, salt, len(tokens), list(tokens), node, node.depth, node.depth)
        self.reqs.append(req)
        return req

    def compute(self, req: Req, n: int, cache: bool = True) -> bool:
        """Allocates and computes the next n positions (a prefill chunk or a decode step)."""
        slots = self.cache.alloc(n)
        if slots is None:
            assert self.allocator.available + self.cache.evictable_size < n
            return False
        in_use = self.tree_slots().keys() | set(self.owned_slots())
        assert in_use.isdisjoint(slots.tolist()), "a slot in use was handed out"
        start = req.computed
        self.table.write(req.row, start, slots)
        for pos, slot in zip(range(start, start + n), slots.tolist()):
            self.kv[slot] = (req.salt, tuple(req.tokens[:pos + 1]))
        req.computed = req.allocated = start + n
        if cache:
            req.node, prefix = self.cache.cache_unfinished(req.row, req.tokens[:req.computed],
                                                           req.salt, req.node, req.owner)
            assert prefix == (req.computed if self.cache.enabled else 0) == req.node.depth
        return True

    def finish(self, req: Req, alloc_last: bool) -> None:
        """Ends a request; with alloc_last, the last token got a slot but its KV was never run."""
        if alloc_last and req.allocated == len(req.tokens) - 1:
            slot = self.cache.alloc(1)
            if slot is not None:
                self.table.write(req.row, req.allocated, slot)
                req.allocated += 1
        self.cache.cache_finished(req.row, req.tokens[:req.allocated], req.salt, req.node,
                                  num_valid=req.computed, owner=req.owner)
        self.table.free_row(req.row)
        self.reqs.remove(req)

    def tree_slots(self) -> dict[int, tuple]:
        """slot -> (salt, prefix) for every slot in the tree."""
        tree = self.cache.tree
        return {s: (n.salt, tree.path_key(n)[:n.depth - len(n.key) + i + 1])
                for n in tree.nodes() for i, s in enumerate(n.value.tolist())}

    def owned_slots(self) -> list[int]:
        """The slots running requests own (past their tree-held prefix)."""
        return [s for r in self.reqs for s in self.table.read(r.row, r.allocated, r.node.depth).tolist()]

    def settle(self) -> None:
        """Forgets the KV of free slots, then checks every invariant."""
        tree = self.cache.tree
        tree.check_invariants()
        held = sum(r.owned for r in self.reqs)
        self.cache.check_pool_whole(held)
        tree_slots, owned = self.tree_slots(), self.owned_slots()
        assert len(owned) == len(set(owned)) == held and set(owned).isdisjoint(tree_slots)
        for slot in set(self.kv) - set(owned) - set(tree_slots):
            del self.kv[slot]
        for slot, entry in tree_slots.items():
            assert self.kv.get(slot) == entry, f"tree slot {slot} holds {self.kv.get(slot)}, not {entry}"
        for r in self.reqs:
            node = r.node  # a running request's node (locked) is still in the tree
            while not node.is_root:
                assert node.parent.children.get(node.key[0]) is node, f"locked {node!r} was evicted"
                node = node.parent
            row = self.table.read(r.row, r.computed).tolist()
            assert row[:r.node.depth] == tree.path_slots(r.node).tolist()
            for pos, slot in enumerate(row):
                assert self.kv.get(slot) == (r.salt, tuple(r.tokens[:pos + 1])), \
                    f"row {r.row} position {pos} reads slot {slot} holding {self.kv.get(slot)}"
        if not self.cache.enabled:
            assert tree.total_size == 0


# shared system-prompt-like heads make prefix hits and concurrent duplicates common
prompts = st.builds(lambda head, tail: head + tail,
                    st.sampled_from([[], [0, 0, 1], [1, 1, 1, 0]]),
                    st.lists(st.integers(0, 2), min_size=1, max_size=5))
salts = st.sampled_from([None, None, "s"])


def prefilling(r):
    return r.computed < r.prompt_len


def decoding(r):
    return r.computed >= r.prompt_len and len(r.tokens) < MAX_TOKENS


class CacheSim(RuleBasedStateMachine):
    enabled = True

    def __init__(self):
        super().__init__()
        self.sim = Sim(self.enabled)

    def pick(self, i, ready):
        choices = [r for r in self.sim.reqs if ready(r)]
        return choices[i % len(choices)]

    @precondition(lambda self: self.sim.table.available > 0)
    @rule(prompt=prompts, salt=salts)
    def start(self, prompt, salt):
        req = self.sim.start(prompt, salt)
        if self.enabled:
            expected = self.sim.cache.tree.match_prefix(prompt[:-1], salt).node.depth
            assert req.node.depth == expected
        self.sim.settle()

    @precondition(lambda self: any(map(prefilling, self.sim.reqs)))
    @rule(i=st.integers(0, 9), chunk=st.integers(1, 4))
    def prefill_chunk(self, i, chunk):
        req = self.pick(i, prefilling)
        if self.sim.compute(req, min(chunk, req.prompt_len - req.computed)) and not prefilling(req):
            req.tokens.append(i % 3)    # the first sampled token
        self.sim.settle()

    @precondition(lambda self: any(map(decoding, self.sim.reqs)))
    @rule(i=st.integers(0, 9), cache=st.booleans())
    def decode(self, i, cache):
        req = self.pick(i, decoding)
        if self.sim.compute(req, 1, cache):
            req.tokens.append((i + req.computed) % 3)
        self.sim.settle()

    @precondition(lambda self: self.sim.reqs)
    @rule(i=st.integers(0, 9), alloc_last=st.booleans())
    def finish(self, i, alloc_last):
        self.sim.finish(self.pick(i, lambda r: True), alloc_last)
        self.sim.settle()

    @rule(roll=st.integers(0, 9))
    def flush(self, roll):
        if roll != 7:   # flushing empties the cache: keep it rare
            return
        locked = any(not r.node.is_root for r in self.sim.reqs)
        assert self.sim.cache.flush() == (not locked)
        if not locked:
            assert self.sim.cache.tree.total_size == 0
        self.sim.settle()


class DisabledCacheSim(CacheSim):
    enabled = False


_settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
CacheSim.TestCase.settings = _settings
DisabledCacheSim.TestCase.settings = settings(_settings, max_examples=40)
test_cache_simulation = CacheSim.TestCase
test_disabled_cache_simulation = DisabledCacheSim.TestCase


def test_concurrent_prefill_of_one_prompt_shares_the_first_copy():
    sim = Sim()
    a, b = sim.start([1, 2, 3, 4, 5]), sim.start([1, 2, 3, 4, 5])
    assert a.node.depth == b.node.depth == 0
    sim.compute(a, 3)
    sim.compute(b, 3, cache=False)
    free_before = sim.allocator.available
    b_own = sim.table.read(b.row, 3).tolist()
    sim.compute(b, 1)     # b caches [1,2,3,4]: 3 duplicates freed, its row now reads a's slots
    assert sim.allocator.available == free_before - 1 + 3
    assert sim.table.read(b.row, 3).tolist() == sim.table.read(a.row, 3).tolist() != b_own
    assert b.node.depth == 4 and sim.cache.protected_size == 4
    sim.settle()


def test_cache_finished_frees_duplicates_and_the_uncomputed_tail():
    sim = Sim()
    a = sim.start([7, 8, 9])
    sim.compute(a, 3)
    a.tokens.append(1)                     # sampled, never run through the model
    sim.finish(a, alloc_last=True)         # [0, 3) cached, the slot of position 3 freed
    assert sim.cache.tree.total_size == 3 and sim.allocator.available == TOTAL_SLOTS - 3
    b = sim.start([7, 8, 9, 5])
    assert b.node.depth == 3
    sim.compute(b, 1)
    b.tokens.append(6)
    sim.compute(b, 1, cache=False)         # a decode step whose KV is computed but not cached yet
    sim.finish(b, alloc_last=False)        # caches all 5 computed positions
    assert sim.cache.tree.total_size == 5 and sim.cache.protected_size == 0
    assert sim.cache.match([7, 8, 9, 5, 6, 0]).slots.numel() == 5
    sim.settle()


def test_cache_finished_rejects_num_valid_inside_the_locked_prefix():
    sim = Sim()
    a = sim.start([1, 2, 3])
    sim.compute(a, 3)
    with pytest.raises(ValueError):
        sim.cache.cache_finished(a.row, a.tokens, None, a.node, num_valid=2)


def test_alloc_evicts_lru_unlocked_entries_when_short():
    sim = Sim(total=8)
    for prompt in ([1, 1, 1], [2, 2, 2], [3, 3]):
        req = sim.start(prompt)
        assert sim.compute(req, len(prompt))
        sim.finish(req, alloc_last=False)
    sim.cache.match([1, 1, 1])             # now [2, 2, 2] is the least recently used
    assert sim.allocator.available == 0
    slots = sim.cache.alloc(2)
    assert slots is not None and sim.cache.tree.total_size == 5
    assert sim.cache.match([2, 2, 2]).slots.numel() == 0
    assert sim.cache.match([1, 1, 1]).slots.numel() == 3
    sim.allocator.free(slots)
    locked = sim.start([1, 1, 1, 0])
    assert sim.cache.alloc(7) is None       # only 5 free + 2 evictable ([3, 3])
    assert sim.cache.match([1, 1, 1]).node is locked.node and sim.cache.tree.total_size == 3
    sim.settle()


def test_flush_refuses_while_a_request_holds_a_lock():
    sim = Sim()
    a = sim.start([4, 5, 6])
    sim.compute(a, 3)
    assert not sim.cache.flush()
    assert sim.cache.tree.total_size == 3
    sim.finish(a, alloc_last=False)
    assert sim.cache.flush()
    assert sim.cache.tree.total_size == 0 and sim.allocator.available == TOTAL_SLOTS
    sim.settle()


def test_disabled_cache_matches_nothing_and_frees_finished_requests():
    sim = Sim(enabled=False)
    for _ in range(2):
        a = sim.start([1, 2, 3])
        assert a.node.depth == 0
        sim.compute(a, 3)
        sim.finish(a, alloc_last=False)
        assert sim.allocator.available == TOTAL_SLOTS and sim.cache.tree.total_size == 0
    assert sim.cache.match([1, 2, 3]).slots.numel() == 0


def test_record_hit_counts_along_the_matched_path_and_nothing_when_disabled():
    sim = Sim()
    a = sim.start([1, 2, 3, 4])
    sim.compute(a, 4)
    sim.finish(a, alloc_last=False)
    b = sim.start([1, 2, 3, 9])  # its cached prefix [1, 2, 3] splits a's node
    sim.cache.record_hit(b.node)
    tree = sim.cache.tree
    top = tree.roots()[None].children[1]
    assert (top.key, top.hits, top.children[4].hits) == ((1, 2, 3), 1, 0)
    sim.compute(b, 1)  # cache_unfinished matches again: no hit
    assert (top.hits, b.node.hits) == (1, 0)
    sim.settle()
    off = Sim(enabled=False)
    c = off.start([1, 2, 3])
    off.cache.record_hit(c.node)  # disabled: the node is a root
    assert c.node.is_root and c.node.hits == 0
