"""Priorities and latency targets with a fake runner and a fake step cost: the step-cost fit, the
prefill budget a target leaves, EDF admission, priority ordering, preemption and giving way.
Every schedule must still give each request the tokens it would get alone (the fake runner's
next token is a function of the tokens so far) and leave the pool whole."""
from __future__ import annotations

import random

import pytest

from stemma.engine.request import Request
from stemma.engine.slo import MIN_CHUNK, Attainment, Slo, p99, victims
from stemma.engine.step_cost import StepCost, StepShape
from stemma.engine_config import PRESETS, EngineConfig
from stemma.sampling_params import SamplingParams
from tests.test_scheduler import Harness, counts, expected

# the fake machine: 10 ms a step, 1 ms a decode row, 0.5 ms a prefill token, 0.1 ms per 1k keys
A, B, C, D = 0.010, 0.001, 0.0005, 0.0001


def true_cost(shape: StepShape) -> float:
    return A + B * shape.decode_rows + C * shape.prefill_tokens + D * shape.attention


def trained_cost(seed: int = 0, noise: float = 0.0) -> StepCost:
    rng = random.Random(seed)
    cost = StepCost()
    for _ in range(64):
        shape = StepShape()
        shape.decode(rng.randrange(1, 200), rows=rng.randrange(0, 16))
        shape.prefill(rng.randrange(0, 128), rng.randrange(0, 64))
        cost.observe(shape, true_cost(shape) * (1 + rng.uniform(-noise, noise)))
    return cost


def harness(cost: StepCost | None = None, **options) -> Harness:
    h = Harness(**options)
    if cost is not None:
        h.scheduler.cost = h.scheduler.slo.cost = cost
    return h


def add(h: Harness, rid: str, tokens: list[int], new: int = 4, arrival: float | None = None, **params) -> Request:
    req = Request(rid=rid, input_ids=tokens, params=SamplingParams(max_new_tokens=new, temperature=0, **params))
    if arrival is not None:
        req.arrival = arrival  # the fake clock: arrival times as the test sets them
    h.scheduler.add(req)
    return req


def finish_all(h: Harness, reqs: list[Request]) -> None:
    h.run()
    for r in reqs:
        assert r.output_ids == expected(r.input_ids, r.params.max_new_tokens), r.rid
    h.scheduler.check_pool_whole()


# ---- the step-cost model ----
def test_step_cost_learns_a_linear_machine():
    cost = trained_cost(noise=0.0)
    a, b, c, d = cost.coef
    assert a == pytest.approx(A, rel=0.05) and b == pytest.approx(B, rel=0.05)
    assert c == pytest.approx(C, rel=0.05) and d == pytest.approx(D, rel=0.2)
    shape = StepShape()
    shape.decode(100, rows=8)
    shape.prefill(50, 10)
    assert cost.predict(shape) == pytest.approx(true_cost(shape), rel=0.02)


def test_step_cost_error_is_the_median_relative_miss():
    cost = trained_cost(noise=0.1)
    rng = random.Random(1)
    for _ in range(50):
        shape = StepShape()
        shape.decode(100, rows=rng.randrange(1, 16))
        actual = true_cost(shape) * (1 + rng.uniform(-0.1, 0.1))
        cost.observe(shape, actual, cost.predict(shape))
    assert 0.0 < cost.error() < 0.1
    stats = cost.stats()
    assert stats["per_decode_row_ms"] == pytest.approx(1e3 * B, rel=0.2)
    assert stats["last_predicted_ms"] > 0


def test_step_cost_needs_a_few_steps_and_never_negative_slopes():
    cost = StepCost()
    assert cost.predict(StepShape(decode_rows=1)) is None
    for rows, seconds in [(1, 0.03), (2, 0.029), (4, 0.031), (8, 0.028), (16, 0.027)]:
        cost.observe(StepShape(decode_rows=rows), seconds)  # noise that falls with rows
    assert all(v >= 0 for v in cost.coef)


# ---- targets and the prefill budget ----
def test_the_prefill_budget_keeps_the_step_within_the_target():
    h = harness(trained_cost(), pool=2048, max_running=16, chunked_prefill_size=512, max_prefill_tokens=512)
    fast = [add(h, f"d{i}", [1 + i, 2, 3], new=30, itl_slo_ms=30.0, priority=1) for i in range(4)]
    h.step()
    h.step()  # four decodes now
    long = add(h, "long", list(range(3, 90)), new=2)  # no target, priority 0
    plan = h.step()
    chunk = counts(plan)["long"]
    # decodes: 10 + 4 * 1 ms (+ keys); 30 ms leaves room for ~30 prefill tokens at 0.5 ms
    shape = StepShape.of(plan)
    assert true_cost(shape) <= 0.030 + 1e-4
    assert 20 <= chunk <= 40
    finish_all(h, fast + [long])


def test_without_targets_nothing_changes():
    h = harness(trained_cost(), pool=2048, max_running=16, chunked_prefill_size=512, max_prefill_tokens=512)
    a = add(h, "a", [1, 2, 3], new=30)
    h.step()
    b = add(h, "b", list(range(3, 90)), new=2)
    assert counts(h.step()) == {"a": 1, "b": 87}
    finish_all(h, [a, b])


def test_a_top_priority_request_always_gets_a_chunk():
    # a target no step can meet: the most urgent request still prefills MIN_CHUNK a step
    h = harness(trained_cost(), pool=2048, max_running=16, chunked_prefill_size=512, max_prefill_tokens=512)
    a = add(h, "a", list(range(1, 60)), new=3, itl_slo_ms=5.0, priority=2)
    assert counts(h.step()) == {"a": MIN_CHUNK}
    finish_all(h, [a])


def test_equal_priorities_join_only_within_the_target():
    # every request has the engine's 20 ms target: 10 ms + 1 ms a decode row (+ keys) holds the
    # batch to about 9 decodes; the rest wait for room instead of slowing everyone
    h = harness(trained_cost(), pool=4096, max_running=32, default_itl_slo_ms=20.0)
    reqs = [add(h, f"r{i}", [1 + i, 2, 3], new=20) for i in range(16)]
    most = 0
    for _ in range(6):
        h.step()
        decodes = [r for r in h.scheduler.running if r.is_decoding]
        most = max(most, len(decodes))
        shape = StepShape()
        for r in decodes:
            shape.decode(len(r.tokens))
        assert true_cost(shape) <= 0.020 + 1e-3
    assert 5 <= most < 16
    finish_all(h, reqs)


# ---- admission order ----
def test_earliest_ttft_deadline_first_within_a_priority():
    h = harness(trained_cost(), pool=2048, max_running=2)
    late = add(h, "late", [1, 2, 3], arrival=100.0, ttft_slo_ms=5000.0)
    soon = add(h, "soon", [4, 5, 6], arrival=101.0, ttft_slo_ms=500.0)
    none = add(h, "none", [7, 8, 9], arrival=99.0)
    plan = h.step()
    assert set(counts(plan)) == {"soon", "late"}  # deadlines 101.5 and 105 before none's inf
    finish_all(h, [late, soon, none])


def test_higher_priority_first():
    h = harness(None, pool=2048, max_running=2)
    low = add(h, "low", [1, 2, 3], arrival=1.0)
    high = add(h, "high", [4, 5, 6], arrival=2.0, priority=5)
    mid = add(h, "mid", [7, 8, 9], arrival=3.0, priority=1)
    assert set(counts(h.step())) == {"high", "mid"}
    finish_all(h, [low, high, mid])


# ---- preemption ----
def test_a_high_priority_request_preempts_a_full_batch_and_nothing_is_lost():
    h = harness(None, pool=2048, max_running=4, priority_preemption_gap=10)
    batch = [add(h, f"b{i}", [10 + i, 2, 3, 4], new=12) for i in range(4)]
    h.step()
    h.step()
    urgent = add(h, "urgent", [50, 51, 52], new=5, priority=10)
    plan = h.step()  # the very next step: one low-priority request retracted, the urgent admitted
    assert "urgent" in counts(plan)
    assert len(urgent.output_ids) == 1            # its first token in that step
    assert h.scheduler.counters.preemptions == 1
    assert sum(r.retractions for r in batch) == 1
    finish_all(h, batch + [urgent])


def test_a_small_gap_does_not_preempt():
    h = harness(None, pool=2048, max_running=2, priority_preemption_gap=10)
    batch = [add(h, f"b{i}", [10 + i, 2, 3], new=6) for i in range(2)]
    h.step()
    urgent = add(h, "urgent", [50, 51], new=2, priority=9)
    assert "urgent" not in counts(h.step())
    assert h.scheduler.counters.preemptions == 0
    finish_all(h, batch + [urgent])


def test_lower_priority_gives_way_to_a_target():
    h = harness(trained_cost(), pool=4096, max_running=32)
    batch = [add(h, f"b{i}", [10 + i, 2, 3], new=40) for i in range(24)]
    h.step()
    h.step()  # 24 decodes: 10 + 24 ms > the 25 ms target below
    chat = add(h, "chat", [60, 61, 62], new=8, itl_slo_ms=25.0, priority=1)
    h.step()
    assert h.scheduler.counters.slo_give_way > 0
    running = [r for r in h.scheduler.running if r.is_decoding]
    shape = StepShape()
    for r in running:
        shape.decode(len(r.tokens))
    assert true_cost(shape) <= 0.025 + 1e-3
    finish_all(h, batch + [chat])
    assert chat.slo is not None and chat.slo["priority"] == 1


def test_victims_lowest_priority_then_least_progress():
    def req(rid, priority, done):
        r = Request(rid=rid, input_ids=[1], params=SamplingParams(priority=priority))
        r.output_ids = [0] * done
        return r
    running = [req("a", 0, 5), req("b", 0, 1), req("c", 3, 0), req("d", -1, 9)]
    assert [r.rid for r in victims(running, below=3)] == ["d", "b", "a"]
    assert victims(running, below=-1) == []


# ---- attainment ----
def test_attainment_scores_ttft_and_p99_itl():
    slo = Slo(EngineConfig(), StepCost())
    req = Request(rid="r", input_ids=[1], params=SamplingParams(ttft_slo_ms=100.0, itl_slo_ms=50.0, priority=2))
    req.arrival, req.first_token_time = 10.0, 10.05
    req.itl = [0.02] * 98 + [0.06, 0.07]
    att = Attainment()
    got = att.score(req, slo)
    assert got["ttft_met"] and not got["itl_met"] and not got["met"]
    assert got["itl_p99_ms"] == pytest.approx(60.0)
    assert att.stats() == {"2": {"requests": 1, "ttft_met": 1, "itl_met": 0, "met": 0}}
    assert Attainment().score(Request(rid="x", input_ids=[1], params=SamplingParams()), slo) is None
    assert p99([1.0]) == 1.0


def test_presets_fill_what_is_not_given():
    cfg = EngineConfig.from_kwargs(preset="interactive", max_running_requests=8)
    assert cfg.max_running_requests == 8                                    # given: kept
    assert cfg.chunked_prefill_size == PRESETS["interactive"]["chunked_prefill_size"]
    assert cfg.default_itl_slo_steps == 2.0
    assert EngineConfig.from_kwargs(preset="throughput").schedule_policy == "lpm"
    with pytest.raises(ValueError, match="preset"):
        EngineConfig.from_kwargs(preset="fast")
    with pytest.raises(ValueError, match="default_itl_slo_ms"):
        EngineConfig(default_itl_slo_ms=0)
    with pytest.raises(ValueError, match="priority_preemption_gap"):
        EngineConfig(priority_preemption_gap=0)


@pytest.mark.parametrize("max_running, preempted", [(2, 0), (1, 1)])
def test_a_request_that_may_preempt_is_not_held_by_retained_kv(max_running, preempted):
    # program policy: a paused program's KV is retained; a waiting request that outranks a running
    # one by the gap takes the room it needs, as retained KV ranks below running requests. With
    # room in the batch the retained KV goes and "low" runs on; with the batch full "low" is
    # preempted, and the urgent request is then admitted, not held back (preempted in vain)
    from stemma.program_call import ProgramCall
    h = harness(None, pool=64, max_running=max_running, priority_preemption_gap=10,
                schedule_policy="program", radix_eviction="program")
    call = Request(rid="p-0", input_ids=list(range(100, 130)), call=ProgramCall("p", 0, pause_s=5.0),
                   params=SamplingParams(max_new_tokens=2, temperature=0))
    h.scheduler.add(call)
    h.run()
    assert h.scheduler.programs.stats()["programs_retained"] == 1  # ~31 tokens kept for p's next call
    low = add(h, "low", list(range(10, 20)), new=30)
    h.step()
    h.step()
    urgent = add(h, "urgent", list(range(200, 240)), new=2, priority=10)  # more than low's KV frees
    h.step()
    assert urgent.admitted_once                                  # not held until the retention ends
    assert h.scheduler.counters.preemptions == preempted
    finish_all(h, [low, urgent])
