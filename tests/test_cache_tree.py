"""The radix tree's hit counts and the CacheTree a dashboard polls: on the tree alone (with a
property test against random inserts, matches and evictions) and on a tiny random llama engine,
through `EngineLoop.handle` and the codec."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import stemma
from stemma import SamplingParams
from stemma import protocol as P
from stemma.cache.radix_tree import RadixTree
from stemma.engine.cache_tree import EDGE_TOKENS, cache_tree, node_dicts, subtree_sizes
from stemma.engine.process import EngineLoop
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

SHORT = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
SHARED = list(range(10, 40))
OWN = ([50, 51, 52], [60, 61], [70])


class Slots:
    """Fresh slot ids, never reused."""

    def __init__(self):
        self.next = 0

    def __call__(self, n):
        self.next += n
        return torch.arange(self.next - n, self.next, dtype=torch.int64)


def insert(tree, key, slots, salt=None):
    tree.insert(key, slots(len(key)), salt)


def by_tokens(nodes):
    return {tuple(n["tokens"]): n for n in nodes}


# ---- hit counts ----
def test_record_hit_counts_on_the_node_and_every_ancestor_and_matching_counts_none():
    tree, slots = RadixTree(), Slots()
    insert(tree, [1, 2, 3, 4], slots)
    insert(tree, [1, 2, 3, 4, 5, 6], slots)
    tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    tree.match_prefix([1, 2, 9])  # ends inside the edge: splits it after [1, 2]
    upper = tree.roots()[None].children[1]
    lower = upper.children[3]
    leaf = lower.children[5]
    assert (upper.key, lower.key, leaf.key) == ((1, 2), (3, 4), (5, 6))
    assert (upper.hits, lower.hits, leaf.hits) == (0, 0, 0)  # matches and inserts count nothing
    tree.record_hit(leaf)
    assert (upper.hits, lower.hits, leaf.hits) == (1, 1, 1)
    tree.record_hit(upper)
    tree.record_hit(tree.match_prefix([1, 2, 3, 4, 8]).node)
    assert (upper.hits, lower.hits, leaf.hits) == (3, 2, 1)
    tree.check_invariants()


def test_record_hit_on_a_root_counts_nothing():
    tree, slots = RadixTree(), Slots()
    insert(tree, [1, 2], slots)
    tree.record_hit(tree.match_prefix([7]).node)               # no match: the root
    tree.record_hit(tree.match_prefix([1, 2], salt="s").node)  # an unknown salt: a fresh root
    assert tree.roots()[None].hits == 0 and tree.roots()[None].children[1].hits == 0
    tree.check_invariants()


def test_split_gives_the_upper_node_the_hits_of_the_node_it_splits():
    tree, slots = RadixTree(), Slots()
    insert(tree, [1, 2, 3, 4], slots)
    node = tree.match_prefix([1, 2, 3, 4]).node
    for _ in range(3):
        tree.record_hit(node)
    upper = tree.match_prefix([1, 2]).node  # splits [1, 2, 3, 4] after [1, 2]
    assert upper.key == (1, 2) and upper.children[3] is node and node.key == (3, 4)
    assert upper.hits == 3 and node.hits == 3
    tree.record_hit(upper)  # a hit on the upper part only
    assert upper.hits == 4 and node.hits == 3
    tree.check_invariants()


# ---- node_dicts on a tree ----
def test_node_dicts_list_the_biggest_subtrees_in_preorder():
    tree, slots = RadixTree(), Slots()
    insert(tree, [1, 2, 3], slots)
    insert(tree, [1, 2, 3, 4, 5], slots)
    insert(tree, [1, 2, 6], slots)
    insert(tree, [7, 8], slots)
    insert(tree, [9], slots, salt="s")
    tree.record_hit(tree.match_prefix([1, 2, 3, 4, 5]).node)
    tree.inc_lock(tree.match_prefix([1, 2, 6]).node)
    tree.record_hit(tree.match_prefix([1, 2, 6]).node)
    nodes = node_dicts(tree, 100)
    assert [n["tokens"] for n in nodes] == [[1, 2], [3], [4, 5], [6], [7, 8], [9]]
    assert [n["id"] for n in nodes] == list(range(6))
    assert [n["parent"] for n in nodes] == [None, 0, 1, 0, None, None]
    assert [n["size"] for n in nodes] == [6, 3, 2, 1, 2, 1]
    assert [n["depth"] for n in nodes] == [2, 3, 5, 3, 2, 1]
    assert [n["hits"] for n in nodes] == [2, 1, 1, 1, 0, 0]
    assert [n["locks"] for n in nodes] == [1, 0, 0, 1, 0, 0]
    assert sum(n["size"] for n in nodes if n["parent"] is None) == tree.total_size
    assert [n["tokens"] for n in node_dicts(tree, 2)] == [[1, 2], [3]]
    assert [n["tokens"] for n in node_dicts(tree, 4)] == [[1, 2], [3], [4, 5], [7, 8]]
    limited = node_dicts(tree, 3)  # [4, 5] and [7, 8] tie for the third place
    assert [n["tokens"] for n in limited[:2]] == [[1, 2], [3]] and limited[2]["size"] == 2


def test_node_dicts_send_the_first_edge_tokens_of_a_long_edge():
    tree, slots = RadixTree(), Slots()
    key = list(range(3 * EDGE_TOKENS))
    insert(tree, key, slots)
    insert(tree, key + [1], slots)
    top, child = node_dicts(tree, 10)
    assert top["tokens"] == key[:EDGE_TOKENS] and top["depth"] == len(key)
    assert top["size"] == len(key) + 1
    assert (child["tokens"], child["parent"], child["depth"]) == ([1], 0, len(key) + 1)


def test_an_empty_tree_lists_nothing():
    assert node_dicts(RadixTree(), 5) == []


ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "hit", "evict", "lock"]),
                         st.lists(st.integers(0, 3), min_size=1, max_size=10),
                         st.sampled_from([None, "a"])), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(1, 12))
def test_node_dicts_on_random_trees(ops, limit):
    tree, slots, locked = RadixTree(), Slots(), []
    for op, key, salt in ops:
        if op == "insert":
            insert(tree, key, slots, salt)
        elif op == "match":
            tree.match_prefix(key, salt)
        elif op == "hit":
            tree.record_hit(tree.match_prefix(key, salt).node)
        elif op == "evict":
            tree.evict(len(key))
        elif locked:
            tree.dec_lock(locked.pop())
        else:
            node = tree.match_prefix(key, salt).node
            tree.inc_lock(node)
            locked.append(node)
    tree.check_invariants()
    everything = node_dicts(tree, 1000)
    nodes = node_dicts(tree, limit)
    assert len(everything) == sum(1 for _ in tree.nodes())
    assert sum(n["size"] for n in everything if n["parent"] is None) == tree.total_size
    assert sorted(n["size"] for n in nodes) == sorted(n["size"] for n in everything)[::-1][:limit][::-1]
    for listing in (everything, nodes):
        assert [n["id"] for n in listing] == list(range(len(listing)))
        for n in listing:
            parent = n["parent"]
            if parent is None:
                assert n["depth"] == len(n["tokens"])  # the child of a root
                continue
            p = listing[parent]
            assert parent < n["id"]
            assert n["depth"] == p["depth"] + len(n["tokens"])
            assert p["size"] > n["size"] and p["hits"] >= n["hits"] and p["locks"] >= n["locks"]
    below = {}
    for n in everything:
        if n["parent"] is not None:
            below[n["parent"]] = below.get(n["parent"], 0) + n["size"]
    for n in everything:
        assert n["size"] == len(n["tokens"]) + below.get(n["id"], 0)


def test_subtree_sizes_sum_each_nodes_own_tokens_and_its_childrens():
    tree, slots = RadixTree(), Slots()
    insert(tree, [1, 2, 3], slots)
    insert(tree, [1, 4], slots)
    size = subtree_sizes(tree)
    top = tree.roots()[None].children[1]
    assert size[top] == 4 and size[top.children[2]] == 2 and size[top.children[4]] == 1


# ---- on an engine ----
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("cache_tree_llama"))))


@pytest.fixture
def engine(folder):
    return stemma.Engine(folder, dtype="float32", attention_backend="torch", kv_pool_tokens=2048,
                         max_running_requests=2)


def test_cache_tree_of_an_engine_after_requests_sharing_a_prefix(engine):
    for own in OWN:
        engine.generate(SHARED + own, SHORT)
    nodes, requests = cache_tree(engine, 20)
    assert requests == []
    top = nodes[0]
    assert (top["tokens"], top["parent"], top["depth"]) == (SHARED, None, len(SHARED))
    assert top["size"] == engine.cache.tree.total_size and top["locks"] == 0
    leaves = [by_tokens(nodes)[tuple(own)] for own in OWN]
    assert all(leaf["parent"] == 0 and leaf["hits"] == 0 for leaf in leaves)  # no prompt came twice
    # the first request computed the shared prefix; each later one found it cached
    assert top["hits"] == len(OWN) - 1
    # each prompt's leaf holds its own tokens; below it, the generated tokens that have KV
    for leaf in leaves:
        (gen,) = [n for n in nodes if n["parent"] == leaf["id"]]
        assert gen["size"] == len(gen["tokens"]) == SHORT.max_new_tokens - 1
    assert sum(n["size"] for n in nodes if n["parent"] is None) == engine.cache.tree.total_size


def top_node(engine):
    (node,) = engine.cache.tree.roots()[None].children.values()
    return node


def test_a_retracted_request_is_not_counted_again_when_it_is_readmitted(engine):
    long = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    engine.generate(SHARED + [50], SHORT)
    (req,) = engine.submit(SHARED + [60], long, rid="r")
    for _ in range(3):
        engine.step()
    shared = top_node(engine)
    assert shared.key == tuple(SHARED) and shared.hits == 1 and req.cached_tokens == len(SHARED)
    own = engine.cache.tree.match_prefix(SHARED + [60]).node
    assert own.key == (60,) and own.hits == 0
    engine.scheduler.retraction.retract(req)  # its computed KV goes to the tree
    assert req.row is None and req.retractions == 1
    engine.step()  # admitted again: it finds its own prompt and outputs cached
    assert req.row is not None and req.node.depth > len(SHARED) + 1
    assert (shared.hits, own.hits) == (1, 0) and req.cached_tokens == len(SHARED)
    engine.cache.tree.check_invariants()
    assert engine.abort("r") is req


def test_under_kv_pressure_each_request_counts_at_most_one_hit(folder, monkeypatch):
    engine = stemma.Engine(folder, dtype="float32", attention_backend="torch", kv_pool_tokens=160,
                           max_running_requests=6, chunked_prefill_size=16)
    recorded = []
    record_hit = engine.cache.record_hit
    monkeypatch.setattr(engine.cache, "record_hit", lambda node, owner=None: (recorded.append(node.depth), record_hit(node, owner)))
    engine.generate(SHARED + [49], SHORT)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    outs = engine.generate([SHARED + [50 + i, 60 + i] for i in range(6)], params)
    assert engine.stats()["retractions"] > 0
    cached = [o.meta["cached_tokens"] for o in outs]
    assert len(recorded) == sum(1 for c in cached if c > 0) and sorted(recorded) == sorted(c for c in cached if c)
    engine.cache.tree.check_invariants()


def test_cache_tree_lists_running_waiting_and_grammar_requests(engine):
    long = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)
    engine.generate(SHARED, SHORT)
    (a,) = engine.submit(SHARED + [50], long, rid="a")
    pair = engine.submit(SHARED + [60], long.replace(n=2), rid="g")
    engine.step()  # admits two (max_running_requests=2); the third waits
    engine.step()
    (c,) = engine.submit("ka lo", SamplingParams(regex="(ka|lo)+"), rid="c")  # its guide builds
    nodes, requests = cache_tree(engine, 20)
    states = {r["rid"]: r["state"] for r in requests}
    assert states == {"a": "running", "g-0": "running", "g-1": "waiting", "c": "grammar"}
    first = requests[0]
    assert first == {"rid": "a", "state": "running", "prompt_tokens": len(SHARED) + 1,
                     "output_tokens": 2, "cached_tokens": len(SHARED)}
    top = nodes[0]
    assert top["tokens"] == SHARED and top["locks"] == 2  # a and g-0 run on it
    for req in [a, *pair, c]:
        assert engine.abort(req.rid) is req
    assert cache_tree(engine, 20) == (node_dicts(engine.cache.tree, 20), [])
    assert cache_tree(engine, 20)[0][0]["locks"] == 0


class Outputs:
    """Stands in for the engine's PUSH socket."""

    def __init__(self):
        self.frames = []

    def send(self, frame):
        self.frames.append(frame)


def test_engine_loop_answers_get_cache_tree_and_the_reply_survives_the_codec(engine):
    engine.generate(SHARED + [50], SHORT)
    engine.submit(SHARED + [60], SHORT, rid="w")
    outputs = Outputs()
    loop = EngineLoop(engine, requests=None, outputs=outputs)
    loop.handle(P.decode(P.encode(P.GetCacheTree(rid="t1", limit=2))))
    (frame,) = outputs.frames
    reply = P.decode(frame)
    assert isinstance(reply, P.CacheTree) and reply.rid == "t1"
    nodes, requests = cache_tree(engine, 2)
    assert reply.nodes == nodes and reply.requests == requests
    assert [n["tokens"] for n in reply.nodes] == [SHARED + [50], reply.nodes[1]["tokens"]]
    assert reply.nodes[1]["parent"] == 0 and len(reply.nodes[1]["tokens"]) == SHORT.max_new_tokens - 1
    assert reply.requests == [{"rid": "w", "state": "waiting", "prompt_tokens": len(SHARED) + 1,
                               "output_tokens": 0, "cached_tokens": 0}]
    assert P.decode(P.encode(reply)) == reply
