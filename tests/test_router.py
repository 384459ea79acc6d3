"""The replica router (issue 20): its prefix index against a naive set of prefixes, the exact
mirror of an engine radix tree fed by that tree's own events, the policies, and the merging of
spread answers."""
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from stemma import protocol as P
from stemma.cache.radix_tree import RadixTree
from stemma.engine.cache_events import CacheEventLog
from stemma.serve.fanout import merge
from stemma.serve.prefix_index import PrefixIndex
from stemma.serve.replica import split_cpus
from stemma.serve.router import Router, Routing

keys = st.lists(st.integers(0, 2), min_size=1, max_size=8)
salts = st.sampled_from([None, "a"])


def naive_match(stored: set, ids, salt) -> int:
    return max((n for n in range(len(ids) + 1) if (salt, tuple(ids[:n])) in stored), default=0)


class IndexVsSet(RuleBasedStateMachine):
    """PrefixIndex against the set of (salt, prefix) it should hold."""

    def __init__(self):
        super().__init__()
        self.index = PrefixIndex()
        self.stored = {(s, ()) for s in (None, "a")}

    @rule(ids=keys, salt=salts)
    def store(self, ids, salt):
        new = self.index.store(ids, salt)
        before = naive_match(self.stored, ids, salt)
        assert new == len(ids) - before
        self.stored |= {(salt, tuple(ids[:n])) for n in range(len(ids) + 1)}

    @rule(ids=keys, keep=st.integers(0, 8), salt=salts)
    def truncate(self, ids, keep, salt):
        keep = min(keep, len(ids))
        if naive_match(self.stored, ids, salt) < keep:
            return  # a replica evicts only what it holds
        gone = {k for k in self.stored if k[0] == salt and len(k[1]) > keep
                and k[1][:keep + 1] == tuple(ids[:keep + 1]) and len(ids) > keep}
        assert self.index.truncate(ids, keep, salt) == len(gone)
        self.stored -= gone

    @rule(limit=st.integers(0, 20))
    def evict_lru(self, limit):
        self.index.evict_lru(limit)
        assert self.index.size <= limit
        held = {(s, p[:n]) for s in (None, "a") for p in self.index.prefixes(s)
                for n in range(len(p) + 1)}
        assert held <= self.stored  # eviction only forgets
        self.stored = held | {(s, ()) for s in (None, "a")}

    @rule(ids=keys, salt=salts)
    def match(self, ids, salt):
        assert self.index.match(ids, salt) == naive_match(self.stored, ids, salt)

    @invariant()
    def size_counts_tokens(self):
        assert self.index.size == len(self.stored) - 2


TestIndexVsSet = IndexVsSet.TestCase
TestIndexVsSet.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


class MirrorOfTree(RuleBasedStateMachine):
    """A router's exact tree, fed only by a RadixTree's CacheEvents, matches what the tree holds
    after any inserts, matches (which split), locks, evictions and resets."""

    def __init__(self):
        super().__init__()
        self.tree = RadixTree()
        self.next_slot = 0
        self.tree.insert([7, 7], self._slots(2))  # held before the log attaches: sent as a store
        self.log = CacheEventLog(self.tree)
        self.router = Router(1, Routing())
        self.locks = []

    def _slots(self, n):
        out = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        return out

    def _sync(self):
        msg = self.log.take()
        if msg is not None:
            msg = P.decode(P.encode(msg), max_bytes=1 << 30)  # over the wire
            self.router.on_events(0, msg.events, msg.salts)

    @rule(ids=keys, salt=salts)
    def insert(self, ids, salt):
        self.tree.insert(ids, self._slots(len(ids)), salt)

    @rule(ids=keys, salt=salts)
    def match_and_lock(self, ids, salt):
        node = self.tree.match_prefix(ids, salt).node
        self.tree.inc_lock(node)
        self.locks.append(node)

    @rule()
    def unlock(self):
        if self.locks:
            self.tree.dec_lock(self.locks.pop(0))

    @rule(n=st.integers(1, 10))
    def evict(self, n):
        self.tree.evict(n)

    @rule()
    def reset(self):
        if not self.locks:
            self.tree.reset()

    @rule(ids=keys, salt=salts)
    def mirror_matches(self, ids, salt):
        self._sync()
        got = self.router.exact[0].match(ids, salt)
        assert got == len(self.tree.match_prefix(ids, salt).slots)


TestMirrorOfTree = MirrorOfTree.TestCase
TestMirrorOfTree.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_cache_events_are_a_version_3_message_inside_a_batch():
    events = P.CacheEvents(events=[[P.CacheEvents.STORE, 0, 0, 1, 2], [P.CacheEvents.CLEAR, 0, -1]],
                           salts=["s"])
    back = P.decode(P.encode(P.Batch(items=[events])))
    assert back.items == [events] and back.items[0].version == 3
    import msgpack
    with pytest.raises(P.ProtocolError, match="needs protocol version 3"):
        P.decode(msgpack.packb({"type": "cache_events", "version": 2, "events": []}))


def forgetful():
    """A clock that moves 2 x FLIGHT_S at each reading: the prompts just routed are forgotten at
    once, so that the router sees the exact tree alone."""
    from stemma.serve.router import FLIGHT_S
    ticks = itertools.count(step=2 * FLIGHT_S)
    return lambda: next(ticks)


def test_cache_aware_prefers_the_replica_holding_the_prefix_until_loads_are_out_of_balance():
    router = Router(2, Routing(balance_abs=4, balance_rel=1.5), clock=forgetful())
    router.on_events(1, [[P.CacheEvents.STORE, 0, -1, 1, 2, 3, 4]], [])
    router.on_events(0, [[P.CacheEvents.CLEAR, 0, -1]], [])
    assert router.choose([1, 2, 3, 4, 9], None, None, [0, 3], [True, True]) == 1      # cached
    assert router.choose([5, 6, 7, 8, 9], None, None, [0, 3], [True, True]) == 0      # least load
    assert router.choose([1, 2, 3, 4, 9], None, None, [1, 9], [True, True]) == 0      # imbalance
    assert router.choose([1, 2, 3, 4, 9], None, None, [1, 5], [True, True]) == 1      # 4 is not > 4
    assert router.choose([1, 2, 3, 4, 9], None, None, [0, 3], [True, False]) == 0     # 1 is down
    with pytest.raises(ValueError, match="no replica"):
        router.choose([1], None, None, [0, 0], [False, False])
    assert router.stats()["reasons"] == {"cache": 2, "load": 2, "balance": 1}


def test_below_the_cache_threshold_it_routes_by_load():
    router = Router(2, Routing(cache_threshold=0.6), clock=forgetful())
    router.on_events(1, [[P.CacheEvents.STORE, 0, -1, 1, 2]], [])
    router.on_events(0, [], [])
    assert router.choose([1, 2, 3, 4], None, None, [2, 0], [True, True]) == 1  # 2/4 < 0.6: load
    assert router.choose([1, 2, 3, 4], None, None, [0, 2], [True, True]) == 0


def test_a_program_stays_on_its_replica_until_it_ends_or_the_replica_goes():
    router = Router(2, Routing())
    first = router.choose([1, 2], None, "agent", [0, 0], [True, True])
    other = 1 - first
    router.on_events(other, [[P.CacheEvents.STORE, 0, -1, 3, 4, 5]], [])
    assert router.choose([3, 4, 5], None, "agent", [0, 0], [True, True]) == first
    router.reset(first)
    assert router.choose([3, 4, 5], None, "agent", [0, 0], [True, True]) == other
    assert router.end_program("agent") == other and router.end_program("agent") is None


def test_round_robin_and_least_load_skip_replicas_that_do_not_serve():
    rr = Router(3, Routing(router="round_robin"))
    assert [rr.choose([1], None, None, [0] * 3, [True, False, True]) for _ in range(4)] == [0, 2, 0, 2]
    ll = Router(3, Routing(router="least_load"))
    assert ll.choose([1], None, None, [5, 1, 2], [True, True, True]) == 1
    assert ll.choose([1], None, None, [5, 1, 2], [True, False, True]) == 2


def test_the_approximate_tree_is_what_was_routed_and_is_bounded():
    router = Router(2, Routing(cache_tree="approximate", approx_max_tokens=6))
    assert router.choose([1, 2, 3, 4], None, None, [0, 0], [True, True]) == 0
    assert router.choose([1, 2, 3, 9], None, None, [0, 0], [True, True]) == 0  # 3/4 routed there
    assert router.approx[0].size == 5
    router.choose([5, 6, 7, 8], None, None, [3, 0], [True, True])
    assert router.approx[1].size == 4 and router.approx[0].size <= 6


def test_routing_options_are_validated():
    for bad in (dict(router="random"), dict(cache_tree="guess"), dict(cache_threshold=1.5),
                dict(balance_abs=-1), dict(balance_rel=0.5), dict(approx_max_tokens=0)):
        with pytest.raises(ValueError):
            Routing(**bad)


@given(st.integers(1, 16), st.integers(1, 8))
def test_cpus_are_split_into_disjoint_even_shares(cpus, parts):
    shares = split_cpus(list(range(cpus)), parts)
    assert len(shares) == parts and all(shares)
    if cpus >= parts:
        flat = [c for share in shares for c in share]
        assert flat == list(range(cpus))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_spread_answers_merge_into_one_reply():
    infos = {0: P.Info(rid="g1", model="m", context_length=8, vocab_size=9,
                       stats={"prompt_tokens": 10, "cached_tokens": 5, "cache_hit_rate": 0.5,
                              "pool_usage": 0.2, "pool_whole": True, "compiled_decode": "off"}),
             1: P.Info(rid="g1", model="m", context_length=8, vocab_size=9,
                       stats={"prompt_tokens": 30, "cached_tokens": 25, "cache_hit_rate": 0.83,
                              "pool_usage": 0.4, "pool_whole": False, "compiled_decode": "off"})}
    stats = merge(infos, {"policy": "cache_aware"}).stats
    assert stats["prompt_tokens"] == 40 and stats["cached_tokens"] == 30
    assert stats["cache_hit_rate"] == 0.75 and stats["pool_usage"] == pytest.approx(0.3)
    assert stats["pool_whole"] is False and stats["router"] == {"policy": "cache_aware"}
    assert [r["replica"] for r in stats["replicas"]] == [0, 1]
    only = {0: infos[0]}
    assert merge(only, None) is infos[0]  # one replica: its answer as it is
    assert merge({0: P.FlushDone(rid="f", ok=True), 1: P.FlushDone(rid="f", ok=False)}, {}).ok is False
    error = P.ErrorMsg(rid="g1", code=P.INTERNAL, message="x")
    assert merge({0: infos[0], 1: error}, {}) is error
    trees = {0: P.CacheTree(rid="t", nodes=[{"id": 0, "parent": None}, {"id": 1, "parent": 0}],
                            requests=[{"rid": "a"}]),
             2: P.CacheTree(rid="t", nodes=[{"id": 0, "parent": None}], requests=[])}
    merged = merge(trees, {})
    assert [(n["id"], n["parent"], n["replica"]) for n in merged.nodes] == [(0, None, 0), (1, 0, 0),
                                                                            (2, None, 2)]
    assert merged.requests == [{"rid": "a", "replica": 0}]
    spec = {i: P.Info(rid="g2", model="m", context_length=8, vocab_size=9,
                      stats={"spec_proposed": proposed, "spec_accepted": 90, "spec_steps": steps,
                             "spec_acceptance_rate": 90 / proposed, "spec_mean_accepted": 90 / steps})
            for i, (proposed, steps) in enumerate([(100, 50), (900, 450)])}
    stats = merge(spec, {}).stats  # the rates of the summed counts: they were replica 0's
    assert stats["spec_acceptance_rate"] == pytest.approx(180 / 1000)
    assert stats["spec_mean_accepted"] == pytest.approx(180 / 500)


def test_the_metrics_show_each_replica_and_the_router():
    from stemma.serve.metrics import Metrics
    router = Router(2, Routing())
    router.choose([1, 2], None, None, [0, 0], [True, True])
    replicas = {i: {"running": i + 1, "prompt_tokens": 10 * i, "cached_tokens": i, "pool_usage": 0.5}
                for i in range(2)}
    info = merge({i: P.Info(rid="s", model="m", context_length=8, vocab_size=9, stats=st)
                  for i, st in replicas.items()}, router.stats())
    metrics = Metrics()
    metrics.on_stats(info.stats)
    text = metrics.render().decode()
    assert "stemma:num_requests_running 3.0" in text  # the sum
    assert 'stemma:replica_num_requests_running{replica="1"} 2.0' in text
    assert 'stemma:replica_cached_tokens_total{replica="1"} 1.0' in text
    assert 'stemma:router_requests_total{replica="0"} 1.0' in text
    assert 'stemma:router_decisions_total{reason="load"} 1.0' in text
    assert 'stemma:router_tree_tokens{replica="0",tree="approx"} 2.0' in text


def test_the_dashboard_rows_name_their_replica():
    from stemma.serve.http.dashboard import DashboardConfig, decoder, node_rows, request_rows
    trees = {i: P.CacheTree(rid="t", nodes=[{"id": 0, "parent": None, "tokens": [5, 6], "depth": 2,
                                             "size": 2, "hits": 1, "locks": 0}],
                            requests=[{"rid": f"g{i}", "state": "running", "prompt_tokens": 3,
                                       "cached_tokens": 2, "output_tokens": 1}]) for i in range(2)}
    merged = merge(trees, {})
    assert [r["replica"] for r in node_rows(merged.nodes, decoder(None), DashboardConfig())] == [0, 1]
    assert [r["replica"] for r in request_rows(merged.requests)] == [0, 1]
    page = (Path(__file__).parents[1] / "stemma/serve/http/dashboard.html").read_text()
    assert '" on replica " + r.replica' in page and '"replica " + n.replica' in page


def test_running_totals_are_counters_that_an_engine_restart_does_not_count_twice():
    from stemma.serve.metrics import Metrics
    metrics = Metrics()
    for proposed in (10, 25, 4, 9):  # the engine restarted after 25 and counts from 0 again
        metrics.on_stats({"spec_proposed": proposed, "programs_ended": 2})
    text = metrics.render().decode()
    assert "stemma:spec_decode_num_draft_tokens_total 30.0" in text  # 10, +15, 4 the new base, +5
    assert "stemma:num_programs_ended_total 2.0" in text
    assert "# TYPE stemma:spec_decode_num_draft_tokens_total counter" in text


def test_only_cache_aware_keeps_a_program_on_its_replica():
    """Under round_robin and least_load a program's calls spread: its end is for every replica
    (end_program None: the gateway sends it to all); it went to the last call's replica alone."""
    for policy in ("round_robin", "least_load"):
        router = Router(2, Routing(router=policy))
        served = {router.choose([1, 2, 3], None, "p", [i % 2, (i + 1) % 2], [True, True]) for i in range(4)}
        assert served == {0, 1} and router.end_program("p") is None, policy
    router = Router(2, Routing())
    first = router.choose([1, 2, 3], None, "p", [0, 0], [True, True])
    assert router.choose([1, 2, 3, 4], None, "p", [3, 0], [True, True]) == first
    assert router.end_program("p") == first


def test_merged_stats_keep_each_replica_s_own_values_and_list_every_program():
    replicas = {i: {"pid": 100 + i, "running": i, "programs": [{"program_id": f"p{i}"}],
                    "slo": {"0": {"requests": 2, "met": 1}, str(i + 5): {"requests": 1, "met": 1}}}
                for i in range(2)}
    stats = merge({i: P.Info(rid="s", model="m", context_length=8, vocab_size=9, stats=st)
                   for i, st in replicas.items()}, None).stats
    assert "pid" not in stats and [r["pid"] for r in stats["replicas"]] == [100, 101]
    assert stats["programs"] == [{"program_id": "p0", "replica": 0}, {"program_id": "p1", "replica": 1}]
    assert stats["slo"] == {"0": {"requests": 4, "met": 2}, "5": {"requests": 1, "met": 1},
                            "6": {"requests": 1, "met": 1}}
    assert stats["running"] == 1


def test_a_burst_sharing_a_prefix_goes_where_the_first_went_before_any_event_returns():
    """The exact tree hears of a prefix once its replica has prefilled it: a burst sent before
    then went by load (to both replicas, each computing the prefix). Routed prompts count as
    their replica's for FLIGHT_S to 2 x FLIGHT_S seconds, until the events have come back."""
    from stemma.serve.router import FLIGHT_S
    now = [0.0]
    router = Router(2, Routing(), clock=lambda: now[0])
    shared = list(range(100, 400))
    loads = [0, 0]
    for i in range(4):
        loads[router.choose(shared + [i], None, None, loads, [True, True])] += 1
    assert loads == [4, 0] and router.reasons == {"load": 1, "cache": 3}
    now[0] += 2 * FLIGHT_S  # no event came back: that replica may have evicted it since
    assert router.choose(shared + [9], None, None, [4, 0], [True, True]) == 1
