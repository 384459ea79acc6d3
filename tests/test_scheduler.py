"""Scheduling decisions with a fake runner and no model weights: admission (budget, chunking, KV
reserve), retraction, policy ordering, one radix match per waiting request per step.

The fake runner plays the model's part of the step contract: it "computes" KV by recording, for
each slot it is asked to fill, the prefix that slot's token ends; before that it checks that
every slot the request reads already holds exactly its own prefix. So a wrong cached prefix, a
slot shared by mistake or a stale row fails the test. Its next token is a function of the tokens
so far, so every schedule must produce the same outputs.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stemma.cache.kv_pool import ReqToSlot, SlotAllocator
from stemma.cache.radix_cache import RadixCache
from stemma.constrained.constrainer import Constrainer
from stemma.engine.plan import StepPlan
from stemma.engine.prefix_match import PrefixMatches, match_cap
from stemma.engine.request import Request
from stemma.engine.scheduler import Scheduler
from stemma.engine.stop import StopRule
from stemma.engine_config import EngineConfig
from stemma.executor.executor import StepOutput
from stemma.sampling_params import SamplingParams

VOCAB = 50
MAX_CONTEXT = 96


def next_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % VOCAB


class FakeRunner:
    def __init__(self, req_to_slot: ReqToSlot):
        self.req_to_slot = req_to_slot
        self.kv: dict[int, tuple] = {}  # slot -> (salt, the token prefix it ends)
        self.plans: list[list[tuple[str, int]]] = []

    def run(self, plan: StepPlan) -> StepOutput:
        self.plans.append([(r.rid, n) for r, n in zip(plan.reqs, plan.counts)])
        for req, n in zip(plan.reqs, plan.counts):
            row = self.req_to_slot.read(req.row, req.kv_len + n).tolist()
            for pos in range(req.kv_len):
                assert self.kv.get(row[pos]) == (req.salt, tuple(req.tokens[:pos + 1])), \
                    f"{req.rid}: slot {row[pos]} at position {pos} holds the wrong KV"
            new = set(row[req.kv_len:])
            assert len(new) == n and not new & set(row[:req.kv_len]), "new slots must be fresh"
            for pos in range(req.kv_len, req.kv_len + n):
                self.kv[row[pos]] = (req.salt, tuple(req.tokens[:pos + 1]))
        return StepOutput(token_ids=[next_token(r.tokens) for r in plan.sampled])


class Harness:
    def __init__(self, pool: int = 512, max_running: int = 8, **options):
        self.config = EngineConfig(kv_pool_tokens=pool, max_running_requests=max_running, **options)
        self.req_to_slot = ReqToSlot(max_running + 1, MAX_CONTEXT)
        self.cache = RadixCache(SlotAllocator(pool), self.req_to_slot, self.config.enable_radix_cache)
        constrainer = Constrainer(None, VOCAB, (), True, 4)
        self.scheduler = Scheduler(self.config, self.cache, self.req_to_slot, constrainer,
                                   StopRule((), MAX_CONTEXT))
        self.runner = FakeRunner(self.req_to_slot)

    def add(self, rid: str, tokens: list[int], new: int = 4, salt: str | None = None) -> Request:
        req = Request(rid=rid, input_ids=tokens, params=SamplingParams(max_new_tokens=new, temperature=0),
                      salt=salt)
        self.scheduler.add(req)
        return req

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        if plan:
            self.scheduler.postprocess(plan, self.runner.run(plan))
        self.scheduler.check_pool_whole()
        self.cache.tree.check_invariants()
        return plan

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work:
                return
            self.step()
        raise AssertionError("requests did not finish")


def expected(tokens: list[int], new: int) -> list[int]:
    out = list(tokens)
    for _ in range(new):
        out.append(next_token(out))
    return out[len(tokens):]


def counts(plan: StepPlan) -> dict[str, int]:
    return {r.rid: n for r, n in zip(plan.reqs, plan.counts)}


def test_chunked_prefill_takes_the_budget_in_chunks_beside_decodes():
    h = Harness(chunked_prefill_size=8, max_prefill_tokens=64)
    a = h.add("a", list(range(1, 4)), new=6)
    assert counts(h.step()) == {"a": 3}
    b = h.add("b", list(range(10, 30)), new=2)  # 20 tokens: chunks of 8, 8, 4
    assert counts(h.step()) == {"a": 1, "b": 8}
    assert counts(h.step()) == {"a": 1, "b": 8}
    assert b.output_ids == [] and not b.is_decoding
    assert counts(h.step()) == {"a": 1, "b": 4}
    assert len(b.output_ids) == 1
    h.run()
    assert a.output_ids == expected(a.input_ids, 6) and b.output_ids == expected(b.input_ids, 2)


def test_unchunked_budget_admits_an_oversized_prompt_only_first():
    h = Harness(chunked_prefill_size=None, max_prefill_tokens=8)
    h.add("a", list(range(1, 13)))
    h.add("b", list(range(20, 32)))
    assert counts(h.step()) == {"a": 12}   # over the budget, but the step's first prefill
    assert counts(h.step()) == {"a": 1, "b": 12}
    h.add("c", list(range(40, 44)))
    h.add("d", list(range(50, 54)))
    assert counts(h.step()) == {"a": 1, "b": 1, "c": 4, "d": 4}


def test_kv_reserve_holds_back_admission_until_decodes_have_room():
    h = Harness(pool=64, kv_reserve_ratio=1.0)
    a = h.add("a", [1, 2, 3, 4], new=40)
    h.step()
    b = h.add("b", list(range(5, 25)), new=8)  # 20 + reserve (39 + 8) > 64 - 5 free
    plan = h.step()
    assert counts(plan) == {"a": 1} and b.row is None
    while not a.finished:  # the reserve for a's remaining decodes never leaves room for b
        h.step()
        assert b.row is None
    h.step()
    assert b.row is not None
    h.run()
    assert b.output_ids == expected(b.input_ids, 8)


def test_retraction_recomputes_and_keeps_outputs():
    prompts = [[i + 1] * 6 + [i + 2, i + 3] for i in range(6)]
    h = Harness(pool=48, max_running=6, kv_reserve_ratio=0.0, schedule_policy="fcfs")
    reqs = [h.add(f"r{i}", p, new=12) for i, p in enumerate(prompts)]
    h.run()
    assert h.scheduler.counters.retractions > 0
    assert any(r.retractions for r in reqs)
    for r, p in zip(reqs, prompts):
        assert r.output_ids == expected(p, 12) and r.finish_reason == "length"


def test_policies_order_admission():
    def first_admitted(policy: str) -> str:
        h = Harness(max_running=1, schedule_policy=policy)
        shared = list(range(1, 21))
        warm = h.add("warm", shared + [30], new=1)
        h.run()
        assert warm.finished
        h.add("long-new", list(range(40, 70)), new=1)   # arrives first, nothing cached
        h.add("cached", shared + [31], new=1)           # 20 tokens cached
        h.add("short", [77, 78], new=1)
        return h.step().reqs[0].rid
    assert first_admitted("fcfs") == "long-new"
    assert first_admitted("lpm") == "cached"
    assert first_admitted("sjf") == "short"


def test_dfs_weight_runs_the_heaviest_shared_prefix_first():
    def admitted(policy: str) -> set[str]:
        h = Harness(max_running=2, schedule_policy=policy)
        group_a, group_b = list(range(1, 17)), list(range(20, 36))
        h.add("warm-a", group_a + [90], new=1)
        h.add("warm-b", group_b + [91], new=1)
        h.run()
        h.add("a1", group_a + [40], new=1)
        for i in range(3):
            h.add(f"b{i}", group_b + [50 + i], new=1)
        return set(counts(h.step()))
    assert admitted("fcfs") == {"a1", "b0"}
    assert admitted("dfs-weight") == {"b0", "b1"}


def test_a_waiting_request_is_matched_once_per_step(monkeypatch):
    h = Harness(max_running=2, schedule_policy="lpm")
    shared = list(range(1, 25))
    h.add("warm", shared + [99], new=1)
    h.run()
    for i in range(6):
        h.add(f"w{i}", shared + [i, i + 1], new=2)
    calls = []
    match = h.cache.match
    monkeypatch.setattr(h.cache, "match", lambda key, salt=None: calls.append(tuple(key)) or match(key, salt))
    while h.scheduler.waiting:
        calls.clear()
        waiting = len(h.scheduler.waiting)
        h.step()
        assert len(calls) <= waiting  # lpm ordering, the shared-prefix check and admission share one
    h.run()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["warm", "evict", "get"]), st.integers(0, 3)), max_size=25))
def test_a_memoized_match_is_what_a_fresh_match_returns(ops):
    h = Harness(pool=48)
    matches = PrefixMatches(h.cache)
    prompts = [[k + 1] * 5 + list(range(10 * k, 10 * k + 6)) for k in range(4)]
    waiting = [Request(rid=f"w{k}", input_ids=p + [99], params=SamplingParams()) for k, p in enumerate(prompts)]
    for op, k in ops:
        if op == "warm":    # a finished request leaves prompt k in the tree
            h.add(f"warm{k}", prompts[k], new=1)
            h.run()
        elif op == "evict":  # an allocation that evicts cached prefixes
            slots = h.cache.alloc(min(8 * (k + 1), h.cache.allocator.available + h.cache.evictable_size))
            h.cache.free(slots)
        else:
            got = matches.get(waiting[k])
            fresh = h.cache.tree.match_prefix(waiting[k].tokens[:match_cap(waiting[k])])
            assert got.node is fresh.node and got.slots.tolist() == fresh.slots.tolist()


def test_in_batch_prefix_sharing_defers_the_second_request_one_step():
    h = Harness()
    prefix = list(range(1, 41))
    h.add("a", prefix + [50], new=2)
    h.add("b", prefix + [51], new=2)
    assert counts(h.step()) == {"a": 41}
    plan = h.step()
    assert counts(plan)["b"] == 1 and h.scheduler.counters.cached_tokens == 40


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_schedule_computes_the_right_kv_and_outputs(data):
    options = dict(
        pool=data.draw(st.sampled_from([40, 64, 256])),
        max_running=data.draw(st.integers(1, 5)),
        chunked_prefill_size=data.draw(st.sampled_from([None, 4, 16])),
        max_prefill_tokens=data.draw(st.sampled_from([8, 32, 128])),
        schedule_policy=data.draw(st.sampled_from(["fcfs", "lpm", "dfs-weight", "sjf"])),
        batching=data.draw(st.sampled_from(["continuous", "static"])),
        enable_radix_cache=data.draw(st.booleans()),
        kv_reserve_ratio=data.draw(st.sampled_from([0.0, 0.3])),
    )
    h = Harness(**options)
    bases = [[1, 2, 3, 4, 5, 6], [9, 9, 9]]
    reqs = []
    for i in range(data.draw(st.integers(1, 7))):
        prompt = data.draw(st.sampled_from(bases)) + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=10))
        salt = data.draw(st.sampled_from([None, None, "s"]))
        reqs.append(h.add(f"r{i}", prompt, new=data.draw(st.integers(0, 10)), salt=salt))
    h.run()
    for r in reqs:
        assert r.finished and r.output_ids == expected(r.input_ids, r.params.max_new_tokens)
    assert not h.scheduler.running and h.req_to_slot.available == h.req_to_slot.max_reqs


def test_abort_and_max_context_are_booked():
    h = Harness()
    with pytest.raises(ValueError, match="does not fit the context"):
        h.add("big", list(range(MAX_CONTEXT)))
    a = h.add("a", [1, 2, 3], new=20)
    h.step()
    assert h.scheduler.abort("a") is a and a.finish_reason == "abort"
    h.scheduler.check_pool_whole()
    long = h.add("long", list(range(MAX_CONTEXT - 3)), new=50)
    h.run()
    assert long.finish_reason == "length" and len(long.tokens) == MAX_CONTEXT


def test_static_batching_waits_for_the_whole_batch():
    h = Harness(batching="static", max_running=2)
    a = h.add("a", [1, 2], new=1)
    b = h.add("b", [3, 4], new=5)
    h.step()
    c = h.add("c", [5, 6], new=1)
    while not b.finished:
        assert c.row is None
        h.step()
    h.run()
    assert a.finished and c.output_ids == expected([5, 6], 1)


def test_a_request_retracted_by_an_earlier_chunk_of_its_step_is_not_scheduled_again():
    """Found by test_any_schedule_...: static batching admits r2 and r3 with no tokens; when the
    pool runs short, r2's allocation retracts r3 and then r2 itself, and r3, already waiting,
    must not be allocated (or retracted) again: it was queued twice and a freed row written."""
    h = Harness(pool=40, max_running=4, chunked_prefill_size=None, max_prefill_tokens=8,
                schedule_policy="fcfs", batching="static", enable_radix_cache=False,
                kv_reserve_ratio=0.0)
    base = [1, 2, 3, 4, 5, 6]
    reqs = [h.add("r0", base + [0] * 7, 3), h.add("r1", base + [0] * 10, 2),
            h.add("r2", base + [0] * 3, 0), h.add("r3", base + [0] * 3, 0)]
    h.run()
    assert h.scheduler.counters.retractions >= 2
    for r in reqs:
        assert r.finished and r.output_ids == expected(r.input_ids, r.params.max_new_tokens)


class _Pool:
    """A KV pool of `free` slots for Retraction alone: a retracted request gives its slots back."""
    def __init__(self, free: int):
        self.free = free

    def alloc(self, n: int):
        if self.free < n:
            return None
        self.free -= n
        return list(range(n))


class _Rows:
    def write(self, row, start, slots):
        pass


@pytest.mark.parametrize("others, retracted", [
    ({"low": 0, "high": 9}, ["low"]),      # a lower priority gives way first
    ({"same": 5, "high": 9}, ["same"]),    # as does an equal one with less progress
    ({"high": 9, "higher": 10}, ["asker"]),  # the asker gives way before any of higher priority
])
def test_a_kv_retraction_takes_the_asker_before_a_higher_priority(others, retracted):
    from collections import deque
    from types import SimpleNamespace

    from stemma.engine.counters import Counters
    from stemma.engine.retraction import Retraction

    def req(name, priority, progress):
        return SimpleNamespace(name=name, params=SimpleNamespace(priority=priority), row=0, kv_len=0,
                               output_ids=[0] * progress, arrival=0.0, retractions=0,
                               prompt_logprobs_done=True, prompt_logprobs=[], state=None)
    asker = req("asker", 5, progress=3)
    running = [asker] + [req(name, p, progress=1) for name, p in others.items()]
    pool, waiting = _Pool(free=0), deque()
    held = {id(r): 4 for r in running}

    def release(r):
        pool.free += held.pop(id(r))
        running.remove(r)

    retraction = Retraction(running, waiting, SimpleNamespace(alloc=pool.alloc), _Rows(), release, Counters())
    assert retraction.alloc_into(asker, 4) == (retracted != ["asker"])
    assert [r.name for r in waiting] == retracted
