"""benchmarks/agents_bound.py's batch model: a lone program's completion is its steps and pauses,
and each queue order admits what it says first."""
import numpy as np
import pytest

from tests.test_latency_options import _benchmark

bound = _benchmark("agents_bound")
STEP = np.array([0.01, 0.0, 0.0, 0.0])   # every step 10 ms (base, per row, per prefill token, per 1k keys)


def prog(pid, arrival, calls, pause=0.0):
    return bound.Prog(pid, arrival, calls, [pause] * (calls - 1), [5] * calls, system=0, system_tokens=20)


def test_a_lone_program_takes_its_steps_and_its_pauses():
    out = bound.replay([prog(0, 1.0, 2, pause=0.5)], "fcfs", STEP, rows=4, gen=3)
    assert out["p50"] == pytest.approx(0.03 + 0.5 + 0.03)
    assert out["waiting"] == 0.0


def test_a_step_costs_its_rows_prefill_and_keys():
    cost = np.array([0.01, 0.002, 0.001, 0.0])
    # first step: nothing decodes yet, 5 + 20 prefill tokens (the system prompt once); then 2 decodes
    out = bound.replay([prog(0, 0.0, 1)], "fcfs", cost, rows=4, gen=3)
    assert out["p50"] == pytest.approx((0.01 + 0.025) + 2 * (0.01 + 0.002))


@pytest.mark.parametrize("policy", ["srpt", "plas"])
def test_a_short_program_goes_before_a_longer_one_s_next_call(policy):
    # one row: a 3-call program, a 1-call one that takes the row while the first pauses (5 ms),
    # and a second 1-call one that arrives (40 ms) after the first's next call is ready (35 ms)
    def done(p):
        progs = [prog(0, 0.0, 3, pause=0.005), prog(2, 0.001, 1), prog(1, 0.04, 1)]
        return bound.replay(progs, p, STEP, rows=1, gen=3)["completion"]
    assert done("fcfs")[1] == pytest.approx(0.12 - 0.04)     # the longer program's call was ready first
    # by fewest calls left (1 against 2) or least service (0 against 28 tokens) it goes first
    assert done(policy)[1] == pytest.approx(0.09 - 0.04)


def test_the_program_order_admits_a_resumed_call_before_a_new_program():
    def done(p):
        return bound.replay([prog(0, 0.0, 2), prog(1, 0.001, 1)], p, STEP, rows=1, gen=3)["completion"]
    # fcfs: the new program (waiting since 1 ms) goes before the long one's second call (ready at 30 ms)
    assert done("fcfs") == pytest.approx({0: 0.09, 1: 0.059})
    # program: the call that resumes a program goes first
    assert done("program") == pytest.approx({0: 0.06, 1: 0.089})
    # srpt: the long program has 1 call left, as has the new one; the older program goes first
    assert done("srpt") == pytest.approx({0: 0.06, 1: 0.089})
