"""The radix tree against a naive reference: a dict from (salt, prefix) to the slot of the
prefix's last token, with the op number that last touched it and the hits recorded through it."""
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from stemma.cache.radix_tree import RadixTree

keys = st.lists(st.integers(0, 2), max_size=8)
salts = st.sampled_from([None, "a", "b"])


def slots(values):
    return torch.tensor(values, dtype=torch.int64)


def tree_content(tree):
    """(salt, prefix) -> slot for every token position in the tree, walked independently."""
    content = {}
    for salt, root in tree.roots().items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, above = stack.pop()
            assert node.parent.children[node.key[0]] is node
            for i, slot in enumerate(node.value.tolist()):
                content[(salt, above + node.key[:i + 1])] = slot
            stack.extend((c, above + node.key) for c in node.children.values())
    return content


class TreeVsReference(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = RadixTree()
        self.entries = {}     # (salt, prefix) -> slot
        self.stamp = {}       # (salt, prefix) -> op number of the last match/insert through it
        self.hits = {}        # (salt, prefix) -> record_hit calls at it or below it
        self.locks = []       # (salt, prefix, node)
        self.op = 0
        self.next_slot = 1
        self.inserted, self.duplicates, self.evicted = set(), set(), set()

    def expected_match(self, salt, key):
        m = 0
        while m < len(key) and (salt, tuple(key[:m + 1])) in self.entries:
            m += 1
        return m

    def touch(self, salt, key, upto):
        self.op += 1
        for j in range(1, upto + 1):
            self.stamp[(salt, tuple(key[:j]))] = self.op

    def check_match(self, salt, key):
        result = self.tree.match_prefix(key, salt)
        m = self.expected_match(salt, key)
        assert result.slots.tolist() == [self.entries[(salt, tuple(key[:j]))] for j in range(1, m + 1)]
        assert result.node.depth == m
        assert self.tree.path_key(result.node) == tuple(key[:m])
        assert result.node.is_root == (m == 0)
        self.touch(salt, key, m)
        return result.node, m

    def locked_prefixes(self):
        return {(salt, prefix[:j]) for salt, prefix, _ in self.locks for j in range(1, len(prefix) + 1)}

    @rule(salt=salts, key=keys)
    def insert(self, salt, key):
        values = list(range(self.next_slot, self.next_slot + len(key)))
        self.next_slot += len(key)
        m = self.expected_match(salt, key)
        assert self.tree.insert(key, slots(values), salt) == m
        self.inserted.update(values)
        self.duplicates.update(values[:m])
        for j in range(m, len(key)):
            self.entries[(salt, tuple(key[:j + 1]))] = values[j]
            self.hits[(salt, tuple(key[:j + 1]))] = 0
        self.touch(salt, key, len(key))

    @rule(salt=salts, key=keys)
    def match(self, salt, key):
        self.check_match(salt, key)

    @rule(salt=salts, key=keys)
    def hit(self, salt, key):
        node, m = self.check_match(salt, key)
        self.tree.record_hit(node)
        for j in range(1, m + 1):
            self.hits[(salt, tuple(key[:j]))] += 1

    @rule(salt=salts, key=keys)
    def lock(self, salt, key):
        node, m = self.check_match(salt, key)
        self.tree.inc_lock(node)
        self.locks.append((salt, tuple(key[:m]), node))

    @precondition(lambda self: self.locks)
    @rule(pick=st.integers(0, 50))
    def unlock(self, pick):
        _, _, node = self.locks.pop(pick % len(self.locks))
        self.tree.dec_lock(node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        locked = self.locked_prefixes()
        freed = self.tree.evict(num_tokens).tolist()
        by_slot = {slot: entry for entry, slot in self.entries.items()}
        gone = [by_slot[slot] for slot in freed]
        assert len(set(gone)) == len(gone)
        assert not locked.intersection(gone), "evicted a locked node or its ancestor"
        for entry in gone:
            del self.entries[entry]
            del self.hits[entry]
        self.evicted.update(freed)
        unlocked = set(self.entries) - locked
        assert len(freed) >= num_tokens or not unlocked, "stopped while unlocked tokens remained"
        leaves = [e for e in unlocked if not any(
            (e[0], e[1] + (t,)) in self.entries for t in range(3))]
        if gone and leaves:
            assert max(self.stamp[e] for e in gone) <= min(self.stamp[e] for e in leaves), "not LRU"

    @invariant()
    def tree_equals_reference(self):
        assert tree_content(self.tree) == self.entries
        self.tree.check_invariants()

    @invariant()
    def hits_match_the_reference(self):
        """A node's hits are those of every prefix ending inside its edge: no split or match
        moves a hit, and an evicted-then-reinserted prefix starts again from none."""
        for salt, root in self.tree.roots().items():
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, above = stack.pop()
                for i in range(len(node.key)):
                    assert self.hits[(salt, above + node.key[:i + 1])] == node.hits
                stack.extend((c, above + node.key) for c in node.children.values())

    @invariant()
    def sizes_add_up(self):
        evictable = sum(len(n.key) for n in self.tree.nodes() if n.lock_ref == 0)
        protected = sum(len(n.key) for n in self.tree.nodes() if n.lock_ref > 0)
        assert (self.tree.evictable_size, self.tree.protected_size) == (evictable, protected)
        assert self.tree.total_size == evictable + protected == len(self.entries)
        assert protected == len(self.locked_prefixes())

    @invariant()
    def slots_are_conserved(self):
        held = [s for n in self.tree.nodes() for s in n.value.tolist()]
        assert len(held) == len(set(held))
        assert set(held).isdisjoint(self.evicted)
        assert set(held) | self.evicted == self.inserted - self.duplicates

    @invariant()
    def locked_nodes_stay(self):
        for salt, prefix, node in self.locks:
            assert node.is_root or node.lock_ref > 0
            assert self.tree.path_key(node) == prefix
            while not node.is_root:
                assert node.parent.children[node.key[0]] is node
                node = node.parent
            assert not prefix or node is self.tree.roots()[salt]


TreeVsReference.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_tree_vs_reference = TreeVsReference.TestCase


def test_match_splits_inside_an_edge_and_keeps_the_lower_node():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], slots([10, 11, 12, 13])) == 0
    lower = tree.match_prefix([1, 2, 3, 4]).node
    result = tree.match_prefix([1, 2, 9])
    assert result.slots.tolist() == [10, 11]
    assert tree.path_key(result.node) == (1, 2) and result.node.depth == 2
    assert lower.parent is result.node and lower.key == (3, 4) and lower.depth == 4
    tree.check_invariants()


def test_insert_keeps_existing_slots_and_reports_the_present_prefix():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots([10, 11, 12]))
    assert tree.insert([1, 2, 5, 6], slots([20, 21, 22, 23])) == 2
    assert tree.match_prefix([1, 2, 5, 6]).slots.tolist() == [10, 11, 22, 23]
    assert tree.total_size == 5


def test_salts_never_share_nodes():
    tree = RadixTree()
    tree.insert([1, 2], slots([10, 11]), salt="x")
    assert tree.match_prefix([1, 2]).slots.numel() == 0
    assert tree.match_prefix([1, 2], salt="y").slots.numel() == 0
    assert tree.insert([1, 2], slots([20, 21])) == 0
    assert tree.match_prefix([1, 2], salt="x").slots.tolist() == [10, 11]
    assert tree.match_prefix([1, 2]).slots.tolist() == [20, 21]


def test_evict_is_lru_and_parents_follow_their_last_child():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots([1, 2, 3]))
    tree.insert([1, 2, 4], slots([1, 2, 4]))   # splits: [1,2] -> {[3], [4]}
    tree.insert([5], slots([5]))
    tree.match_prefix([1, 2, 3])
    assert tree.evict(1).tolist() == [4]
    assert tree.evict(1).tolist() == [5]
    assert sorted(tree.evict(3).tolist()) == [1, 2, 3]
    assert tree.total_size == 0 and tree.evict(1).numel() == 0


def test_locked_path_survives_eviction_and_unlock_restores_sizes():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots([1, 2, 3]))
    tree.insert([1, 2, 7, 8], slots([1, 2, 7, 8]))
    node = tree.match_prefix([1, 2, 3]).node
    tree.inc_lock(node)
    assert (tree.evictable_size, tree.protected_size) == (2, 3)
    assert sorted(tree.evict(100).tolist()) == [7, 8]
    assert tree.match_prefix([1, 2, 3]).slots.tolist() == [1, 2, 3]
    tree.dec_lock(node)
    assert (tree.evictable_size, tree.protected_size) == (3, 0)
    with pytest.raises(RuntimeError):
        tree.dec_lock(node)


def test_eviction_drops_an_emptied_salt_root_and_reset_forgets_all():
    tree = RadixTree()
    tree.insert([1], slots([1]), salt="s")
    assert "s" in tree.roots()
    assert tree.evict(1).tolist() == [1]
    assert "s" not in tree.roots()
    tree.insert([2, 3], slots([2, 3]))
    tree.inc_lock(tree.match_prefix([2, 3]).node)
    tree.reset()
    assert tree.total_size == 0 and list(tree.nodes()) == [] and list(tree.roots()) == [None]


def test_insert_rejects_a_length_mismatch():
    with pytest.raises(ValueError):
        RadixTree().insert([1, 2], slots([1]))


def test_record_hit_walks_to_the_root_and_a_split_keeps_the_count_above():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots([10, 11, 12, 13]))
    tree.insert([1, 2, 3, 4, 5], slots([10, 11, 12, 13, 14]))
    leaf = tree.match_prefix([1, 2, 3, 4, 5]).node
    top = leaf.parent
    for _ in range(2):
        tree.match_prefix([1, 2, 3, 4, 5])  # matching alone counts nothing
    assert (top.hits, leaf.hits) == (0, 0)
    tree.record_hit(leaf)
    tree.record_hit(top)
    assert (top.hits, leaf.hits) == (2, 1)
    upper = tree.match_prefix([1, 2, 7]).node  # splits [1, 2, 3, 4] after [1, 2]
    assert upper.children[3] is top and (upper.hits, top.hits, leaf.hits) == (2, 2, 1)
    tree.record_hit(upper)
    tree.record_hit(tree.roots()[None])  # a root counts nothing
    assert (upper.hits, top.hits, leaf.hits) == (3, 2, 1)
    tree.check_invariants()
    leaf.hits = 3  # more than its parent
    with pytest.raises(AssertionError, match="more hits than its parent"):
        tree.check_invariants()
