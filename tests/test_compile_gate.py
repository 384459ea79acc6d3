"""The compile gate: a background compile's Python waits while forwards run and IDLE_AFTER beyond,
and never past a stuck forward's bound."""
import threading
import time

import pytest

from stemma.executor import compile_gate
from stemma.executor.compile_gate import IDLE_AFTER, CompileGate


def tick() -> None:
    """A Python call: where the trace function looks at the gate."""


class Worker:
    """A thread that calls Python under `gate.paced()` and counts its calls."""

    def __init__(self, gate: CompileGate):
        self.calls, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, args=(gate,), daemon=True)
        self.thread.start()

    def run(self, gate: CompileGate) -> None:
        with gate.paced():
            while not self.stop.is_set():
                tick()
                self.calls += 1

    def calls_over(self, seconds: float) -> int:
        before = self.calls
        time.sleep(seconds)
        return self.calls - before

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_a_compile_threads_python_waits_while_a_forward_runs_and_goes_on_after():
    gate = CompileGate()
    worker = Worker(gate)
    try:
        assert worker.calls_over(0.1) > 100           # no forward: it runs
        with gate.forward():
            time.sleep(0.02)                          # the thread meets the gate at its next call
            assert worker.calls_over(0.3) <= 1
        assert worker.calls_over(IDLE_AFTER / 2) <= 1  # the forward ended just now: still waiting
        time.sleep(IDLE_AFTER)
        assert worker.calls_over(0.1) > 100
        assert gate.waited >= 0.3 and gate.begun == 1 and gate.active == 0
    finally:
        worker.end()


def test_a_thread_paced_inside_a_forward_waits_for_that_forward():
    """A bucket's compile is queued by a forward that meets it, and its thread starts then."""
    gate = CompileGate()
    with gate.forward():
        worker = Worker(gate)
        try:
            assert worker.calls_over(0.2) <= 1
        finally:
            worker.stop.set()
    time.sleep(IDLE_AFTER * 1.5)
    worker.end()


def test_the_gate_holds_while_any_of_overlapping_forwards_runs():
    gate = CompileGate()
    worker = Worker(gate)
    first, second = gate.forward(), gate.forward()
    try:
        first.__enter__()
        second.__enter__()
        time.sleep(0.02)
        first.__exit__(None, None, None)
        assert worker.calls_over(IDLE_AFTER * 3) <= 1  # the second still runs
        second.__exit__(None, None, None)
        time.sleep(IDLE_AFTER * 1.5)
        assert worker.calls_over(0.1) > 100
    finally:
        worker.end()


def test_a_forward_stuck_past_its_bound_opens_the_gate(monkeypatch):
    """The forward may be waiting for a lock the paused thread holds: no wait is unbounded."""
    monkeypatch.setattr(compile_gate, "STUCK_AFTER_MIN", 0.2)
    gate = CompileGate()
    worker = Worker(gate)
    try:
        with gate.forward():
            time.sleep(0.02)
            assert worker.calls_over(0.1) <= 1
            time.sleep(0.15)                           # past 0.2 s since the forward began
            assert worker.calls_over(0.1) > 100
        assert gate.stuck == 1 and gate.longest == 0.0  # a stall does not lengthen the next bound
    finally:
        worker.end()


def test_the_bound_grows_with_the_longest_forward(monkeypatch):
    monkeypatch.setattr(compile_gate, "STUCK_AFTER_MIN", 0.01)
    gate = CompileGate()
    with gate.forward():
        time.sleep(0.05)
    assert gate.longest == pytest.approx(0.05, abs=0.04)
    with gate.forward():
        now = time.monotonic()
        assert gate.closed_for(now) == pytest.approx(compile_gate.STUCK_FACTOR * gate.longest, abs=0.01)
    assert gate.closed_for(time.monotonic()) == pytest.approx(IDLE_AFTER, abs=0.01)


def test_paced_restores_the_threads_trace_function():
    import sys
    gate, mine = CompileGate(), lambda frame, event, arg: None
    sys.settrace(mine)
    try:
        with gate.paced():
            assert sys.gettrace() not in (None, mine)
        assert sys.gettrace() is mine
    finally:
        sys.settrace(None)
