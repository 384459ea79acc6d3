"""Program-aware scheduling and KV retention (issue 19), below the engine: the ProgramCall and its
wire form, the program records, the eviction rank, the "program" policy, and the radix cache
under random program traces (hypothesis) with retention and eviction by program."""
from types import SimpleNamespace

import msgpack
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import precondition, rule

from stemma import protocol as P
from stemma.cache.radix_tree import RadixTree
from stemma.engine import policy
from stemma.engine.programs import DEFAULT_PAUSE_S, RETENTION_FACTOR, RETENTION_SLACK_S, Programs, RetentionGuard
from stemma.engine.request import Request
from stemma.program_call import ProgramCall
from stemma.sampling_params import SamplingParams
from tests.test_radix_cache import CacheSim, Sim

import torch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# ---- the ProgramCall and the wire ----
def test_program_call_checks_its_fields():
    call = ProgramCall("p1", 3, fork_parent=1, continues=False, pause_s=0.25)
    assert ProgramCall.from_dict(call.to_dict()) == call
    for bad, match in [(dict(program_id=""), "program_id"), (dict(program_id="x" * 257), "program_id"),
                       (dict(program_id="p", call_index=-1), "call_index"),
                       (dict(program_id="p", call_index=True), "call_index"),
                       (dict(program_id="p", call_index=2, fork_parent=2), "fork_parent"),
                       (dict(program_id="p", continues=1), "continues"),
                       (dict(program_id="p", pause_s=-1.0), "pause_s"),
                       (dict(program_id="p", pause_s=float("nan")), "pause_s"),
                       (dict(program_id="p", pause_s=10**400), "pause_s must be finite"),
                       (dict(program_id="p", color=1), "unknown program call fields: color"),
                       (dict(call_index=1), "needs program_id")]:
        with pytest.raises(ValueError, match=match):
            ProgramCall.from_dict(bad)


def test_generate_carries_the_program_context_from_version_2():
    call = ProgramCall("agent-7", 2, fork_parent=1, pause_s=0.3)
    msg = P.GenerateReq(rid="r", input_ids=[1, 2], call=call)
    back = P.decode(P.encode(msg))
    assert back == msg and back.call == call and back.version == 2
    # a version-1 sender (no program context) is still understood
    old = msgpack.packb({"type": "generate", "version": 1, "rid": "r", "input_ids": [1, 2]})
    assert P.decode(old).call is None
    for frame, match in [
        ({"type": "generate", "version": 1, "rid": "r", "input_ids": [1], "call": call.to_dict()},
         "needs protocol version 2"),
        ({"type": "end_program", "version": 1, "rid": "r", "program_id": "p"}, "needs protocol version 2"),
        ({"type": "generate", "version": 2, "rid": "r", "input_ids": [1], "call": {"program_id": 5}},
         "program_id"),
        ({"type": "generate", "version": 2, "rid": "r", "input_ids": [1], "call": "p"}, "must be a map"),
        ({"type": "generate", "version": P.PROTOCOL_VERSION + 1, "rid": "r", "input_ids": [1]},
         f"version {P.PROTOCOL_VERSION + 1}"),
    ]:
        with pytest.raises(P.ProtocolError, match=match) as err:
            P.decode(msgpack.packb(frame))
        assert err.value.rid == "r"
    end = P.EndProgram(rid="e", program_id="agent-7")
    assert P.decode(P.encode(end), P.CLIENT_REQUESTS) == end
    # what carries no program context goes out at version 1, as a version-1 side expects it
    plain = msgpack.unpackb(P.encode(P.GenerateReq(rid="r", input_ids=[1])))
    assert plain["version"] == 1 and "call" not in plain
    assert msgpack.unpackb(P.encode(P.HealthOk(rid="h")))["version"] == 1
    assert msgpack.unpackb(P.encode(end))["version"] == msgpack.unpackb(P.encode(msg))["version"] == 2


# ---- the records ----
def call_req(programs, pid, index=0, prompt=(1, 2, 3), continues=True, pause_s=None, arrival=None):
    req = Request(rid=f"{pid}-{index}", input_ids=list(prompt), params=SamplingParams(),
                  call=ProgramCall(pid, index, continues=continues, pause_s=pause_s))
    req.arrival = programs.clock() if arrival is None else arrival
    programs.on_submit(req)
    return req


def test_records_book_service_pauses_and_retention():
    clock = Clock()
    programs = Programs(retention_max_s=30.0, starvation_s=5.0, clock=clock)
    a = call_req(programs, "a")
    a.admit_time, a.cached_tokens = clock.now + 0.5, 2
    programs.on_admitted(a)
    programs.on_computed(a, 1)
    programs.on_computed(a, 4)
    a.output_ids = [7, 8, 9]
    clock.now += 2.0
    programs.on_finish(a, kv_len=5)
    rec = a.program
    assert (rec.calls, rec.attained, rec.prompt_tokens, rec.cached_tokens, rec.generated_tokens) == (1, 5, 3, 2, 3)
    assert rec.wait_s == pytest.approx(0.5) and rec.compute_s == pytest.approx(1.5)
    assert rec.last_kv_len == 5 and not rec.ended
    # nothing measured yet: the default pause
    assert rec.keep_until == pytest.approx(clock.now + RETENTION_FACTOR * DEFAULT_PAUSE_S + RETENTION_SLACK_S)
    clock.now += 0.4
    b = call_req(programs, "a", 1, pause_s=0.1)
    assert b.program is rec and list(rec.pauses) == [pytest.approx(0.4)] and rec.in_flight == 1
    clock.now += 0.1
    programs.on_finish(b, kv_len=9)
    assert rec.keep_until == pytest.approx(clock.now + RETENTION_FACTOR * 0.4 + RETENTION_SLACK_S)  # measured > hint
    c = call_req(programs, "a", 2, continues=False)
    programs.on_finish(c, kv_len=12)
    assert rec.ended and programs.stats()["programs_ended"] == 1
    stats = programs.stats()
    assert stats["programs"][0]["program_id"] == "a" and stats["programs"][0]["calls"] == 3
    # a new program with no pause of its own: the median of all recent pauses (0.4 and 0.0)
    d = call_req(programs, "d")
    programs.on_finish(d, kv_len=3)
    assert d.program.keep_until == pytest.approx(clock.now + RETENTION_FACTOR * 0.2 + RETENTION_SLACK_S)


def test_the_retention_is_capped_and_end_program_ends_it():
    clock = Clock()
    programs = Programs(retention_max_s=2.0, starvation_s=5.0, clock=clock)
    a = call_req(programs, "a", pause_s=100.0)
    programs.on_finish(a, kv_len=3)
    assert a.program.keep_until == pytest.approx(clock.now + 2.0)
    programs.end("a")
    programs.end("nobody")  # ignored
    assert a.program.ended
    call_req(programs, "a", 1)  # a call after the end: the id is live again
    assert not a.program.ended and programs.stats()["programs_ended"] == 0


def test_records_past_the_limit_are_dropped_idle_first_and_count_as_ended():
    programs = Programs(retention_max_s=2.0, starvation_s=5.0, clock=Clock(), max_records=2)
    a = call_req(programs, "a")
    programs.on_finish(a, kv_len=1)
    b = call_req(programs, "b")  # still in flight
    call_req(programs, "c")
    assert set(programs.records) == {"b", "c"} and a.program.ended and not b.program.ended


def test_eviction_rank_orders_ended_then_expired_then_plain_then_retained():
    clock = Clock()
    programs = Programs(retention_max_s=30.0, starvation_s=5.0, clock=clock)
    tree = RadixTree()
    ended, expired, retained, running = (call_req(programs, p) for p in ("ended", "expired", "kept", "run"))
    for req in (ended, expired, retained):
        programs.on_finish(req, kv_len=2)
    programs.end("ended")
    expired.program.keep_until = clock.now - 1
    owners = {1: retained.program, 2: expired.program, 3: None, 4: ended.program, 5: running.program}
    for first, owner in owners.items():  # inserted in this order: LRU alone would evict 1 first
        tree.insert([first, 0], torch.tensor([2 * first, 2 * first + 1]), owner=owner)
    order = []
    while tree.total_size:
        order.append(int(tree.evict(1, programs.eviction_rank)[0]) // 2)
    assert order == [4, 2, 3, 1, 5]
    # a split keeps the owner on both parts; a hit by another owner makes the path shared
    tree.insert([7, 7, 7], torch.tensor([20, 21, 22]), owner=retained.program)
    node = tree.match_prefix([7, 7, 1]).node
    lower = next(iter(node.children.values()))
    assert node.owner is lower.owner is retained.program
    tree.record_hit(node, retained.program)
    assert node.owner is retained.program
    tree.record_hit(node, expired.program)
    assert node.owner is None and lower.owner is retained.program


def test_retained_kv_goes_first_for_the_program_expected_back_last_and_in_flight_last():
    clock = Clock()
    programs = Programs(retention_max_s=30.0, starvation_s=5.0, clock=clock)
    tree = RadixTree()
    soon, late, back = (call_req(programs, p, pause_s=pause) for p, pause in
                        (("soon", 0.2), ("late", 5.0), ("back", 5.0)))
    for req in (soon, late, back):
        programs.on_finish(req, kv_len=2)
    call_req(programs, "back", 1)  # its next call is queued: its KV is needed now
    for first, req in ((1, back), (2, soon), (3, late)):
        tree.insert([first, 0], torch.tensor([2 * first, 2 * first + 1]), owner=req.program)
    order = [int(tree.evict(1, programs.eviction_rank)[0]) // 2 for _ in range(3)]
    assert order == [3, 2, 1]


def paused_in_tree(pause_s: float):
    """Programs on a fake clock and a tree holding the 8 retained tokens of one paused program."""
    clock = Clock()
    programs = Programs(retention_max_s=30.0, starvation_s=5.0, clock=clock)
    tree = RadixTree()
    paused = call_req(programs, "paused", prompt=range(8), pause_s=pause_s)
    programs.on_finish(paused, kv_len=8)
    tree.insert(list(range(8)), torch.arange(8), owner=paused.program)
    return clock, programs, tree, paused


def test_the_retention_guard_defers_new_work_that_would_evict_retained_kv():
    clock, programs, tree, paused = paused_in_tree(pause_s=5.0)
    guard = RetentionGuard(programs, tree, available=4)
    assert guard.retained is None  # measured at its first check
    small = call_req(programs, "small", prompt=[50, 51, 52])
    big = call_req(programs, "big", prompt=[60, 61, 62, 63])
    assert guard.fits(small, cached=0) and guard.retained == {id(paused.program): 8} and guard.free == 4
    guard.take(small, cached=0)
    assert guard.free == 1
    assert not guard.fits(big, cached=0)                         # it would evict the paused KV
    resumed = call_req(programs, "paused", 1, prompt=list(range(8)) + [70, 71])
    assert guard.fits(resumed, cached=8)                         # its own KV: it goes on
    starved = call_req(programs, "old", prompt=[80, 81, 82, 83], arrival=clock.now - 6.0)
    assert guard.fits(starved, cached=0)                         # waited past the bound
    plain = Request(rid="plain", input_ids=[90, 91, 92, 93], params=SamplingParams())
    plain.arrival = clock.now - 6.0
    assert guard.fits(plain, cached=0)                           # so does a request of no program
    plain.arrival = clock.now
    assert not guard.fits(plain, cached=0)
    plain.retractions = 1
    assert guard.fits(plain, cached=0)                           # it was running: retracted for KV
    # each call adds KV to its program: the active programs' next growth is held back too
    nxt = call_req(programs, "small", 1, prompt=[50, 51, 52, 53, 54, 55])
    programs.on_finish(small, kv_len=3)
    programs.on_finish(nxt, kv_len=9)
    assert programs.growth() == 6
    assert programs.active() == 4  # paused (retained), small (retained), big and old (queued)
    fresh = RetentionGuard(programs, tree, available=40)
    fresh.fits(big, cached=0)
    assert fresh.free == 40 + 8 - 8 - 4 * 6
    # a call that never ran leaves the program's last KV as it was
    aborted = call_req(programs, "small", 2)
    programs.on_finish(aborted, kv_len=0)
    assert small.program.last_kv_len == 9


def test_the_guard_frees_only_what_can_go_before_retained_kv_and_says_when_to_look_again():
    _, programs, tree, paused = paused_in_tree(pause_s=2.0)
    tree.insert([0, 1, 2, 3, 20, 21], torch.tensor([0, 1, 2, 3, 20, 21]))
    shared = tree.match_prefix([0, 1, 2, 3]).node
    tree.record_hit(shared, owner=None)  # the first 4 tokens are shared now; 4..7 stay retained
    assert shared.owner is None and tree.evictable_size == 10
    guard = RetentionGuard(programs, tree, available=1)
    waiting = call_req(programs, "waiting", prompt=[30, 31, 32, 33])
    # only [20, 21] can go without the paused KV going first: the shared 4 tokens sit above it
    assert not guard.fits(waiting, cached=0) and guard.free == 1 + 2
    assert guard.retained == {id(paused.program): 4}
    assert guard.wakes_at() == paused.program.keep_until   # its retention ends before 5 s pass
    small = call_req(programs, "small", prompt=[40, 41, 42])
    assert guard.fits(small, cached=0)
    # while nothing runs, the KV of a program whose call waits holds nobody back
    queued = call_req(programs, "paused", 1, prompt=[9, 9])  # its call is in flight now
    assert RetentionGuard(programs, tree, available=1).fits(waiting, cached=0) is False
    assert RetentionGuard(programs, tree, available=1, protect_waiting=False).fits(waiting, cached=0)
    assert queued.program.in_flight == 1
    clean = RetentionGuard(programs, tree, available=1)
    assert clean.wakes_at() is None  # it refused nothing


# ---- the policy ----
def test_program_policy_orders_by_attained_service_resumes_first_and_bounds_starvation():
    clock = Clock()
    programs = Programs(retention_max_s=30.0, starvation_s=5.0, clock=clock)
    import time
    now = time.perf_counter()
    heavy = call_req(programs, "heavy", arrival=now)
    heavy.program.attained = 500
    light = call_req(programs, "light", arrival=now + 0.01)
    light.program.attained = 20
    plain = Request(rid="plain", input_ids=[5, 5], params=SamplingParams())
    plain.arrival = now + 0.02
    resumed = call_req(programs, "resumed", 3, prompt=list(range(40)), arrival=now + 0.03)
    resumed.program.attained, resumed.program.last_kv_len = 900, 30
    fork_a = call_req(programs, "light", 1, arrival=now + 0.04)
    starved = call_req(programs, "old", arrival=now - 10.0)
    starved.program.attained = 10_000
    cached = {id(resumed): 29}

    def match(r):
        return cached.get(id(r), 0), None

    order = policy.order([heavy, light, plain, resumed, fork_a, starved], "program", match, 128)
    assert [r.rid for r in order] == ["old-0", "resumed-3", "plain", "light-0", "light-1", "heavy-0"]
    # past the fallback length nothing is matched, so nothing counts as resumed
    order = policy.order([heavy, resumed, light], "program", match, 2)
    assert [r.rid for r in order] == ["light-0", "heavy-0", "resumed-3"]


# ---- the radix cache under random program traces ----
PROGRAMS = ("p0", "p1", "p2")


class ProgramCacheSim(CacheSim):
    """CacheSim's requests, each a call of one of a few programs (or of none), with the cache
    evicting by program rank under a clock the rules move; every invariant of Sim.settle holds
    after each rule (the pool is whole, no locked node or slot a request reads is freed)."""

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.programs = Programs(retention_max_s=3.0, starvation_s=5.0, clock=self.clock)
        self.sim = Sim(rank=self.programs.eviction_rank)
        self.calls: dict[int, SimpleNamespace] = {}

    @precondition(lambda self: self.sim.table.available > 0)
    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9), program=st.sampled_from(PROGRAMS + (None,)),
          pause=st.none() | st.floats(0.0, 5.0))
    def start_call(self, prompt, program, pause):
        req = self.sim.start(prompt)
        if program is not None:
            call = SimpleNamespace(call=ProgramCall(program, 0, pause_s=pause), arrival=self.clock.now,
                                   program=None, input_ids=prompt, output_ids=[], cached_tokens=0,
                                   admit_time=self.clock.now)
            self.programs.on_submit(call)
            req.owner = call.program
            self.calls[id(req)] = call
        self.sim.settle()

    @precondition(lambda self: self.sim.reqs)
    @rule(i=st.integers(0, 9), alloc_last=st.booleans())
    def finish(self, i, alloc_last):
        req = self.pick(i, lambda r: True)
        self.sim.finish(req, alloc_last)
        call = self.calls.pop(id(req), None)
        if call is not None:
            self.programs.on_finish(call, req.computed)
        self.sim.settle()

    @rule(program=st.sampled_from(PROGRAMS))
    def end_program(self, program):
        self.programs.end(program)

    @rule(seconds=st.floats(0.0, 4.0))
    def wait(self, seconds):
        self.clock.now += seconds

    @rule(n=st.integers(1, 16))
    def pressure(self, n):
        """An allocation that evicts (by program rank) as much as it must; given back at once."""
        locked_before = [r.node for r in self.sim.reqs]
        slots = self.sim.cache.alloc(n)
        if slots is not None:
            self.sim.allocator.free(slots)
        assert [r.node for r in self.sim.reqs] == locked_before
        self.sim.settle()


ProgramCacheSim.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_program_cache_simulation = ProgramCacheSim.TestCase


def test_the_record_cap_drops_ended_then_expired_then_retained_programs():
    """At the cap, a paused program whose KV is retained went first when its call was the oldest
    (marked ended: its KV evicted first) while ended records could go instead."""
    clock = Clock()
    programs = Programs(retention_max_s=30.0, starvation_s=15.0, clock=clock, max_records=3)
    agent = call_req(programs, "agent", pause_s=10.0)
    for i in range(2):
        short = call_req(programs, f"short{i}")
        programs.on_finish(short, kv_len=20)
        programs.end(f"short{i}")
    programs.on_finish(agent, kv_len=60)  # paused in a 10 s tool: retained
    call_req(programs, "newcomer")
    assert list(programs.records) == ["agent", "short1", "newcomer"] and not agent.program.ended
    stats = programs.stats()
    assert (stats["programs_live"], stats["programs_retained"]) == (2, 1)  # agent and newcomer
    clock.now += 60.0  # the agent never calls again, nor ends: its retention is over
    assert programs.stats()["programs_live"] == 1  # the newcomer's call is still in flight
