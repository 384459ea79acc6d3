"""A background compile's Python waits while forwards run, so that it takes only the engine's idle time.

Dynamo's tracing and Inductor's lowering are Python that holds the GIL, and an eager forward
lets the GIL go and takes it back around each of its small ops (some 2,500 a decode step): with a
compile thread beside it, each take waits for that thread to let go. The CPU priority does not
help: the thread runs on the core that the waiting step leaves idle. Without this gate, on 2
cores (benchmarks/compile_load.py), a REPL-like run's slowest request decoded at 13 tok/s while
its graphs compiled, against 125 before, and a 64-request batch run back to back fell to 55 tok/s
in rounds where a graph was traced, against about 450 before. So a compile thread runs under a
trace function (`sys.settrace`, on that thread only) that, at each Python call, waits while any
forward of the process runs or ended less than IDLE_AFTER ago. The compiler processes it starts
need no GIL: they run at the lowest CPU priority (`compiled_decode`). Under a load that never
lets up, the compile advances only in the load's gaps (over 75 rounds of that batch back to
back, 5 minutes, none of its graphs was done); the trace function costs the compile itself
about 60% more time (a warm-cache compile of the one-request graph and the row ops, model load
included, took 48-51 s under it against 29-31 s).

Invariants:
- a paced thread holds no lock that a forward waits for by design: its torch.fx trace windows
  patch for that thread only (`trace_guard`), and where they cannot, the compile holds GUARD
  throughout and is not paced (`compiled_decode`);
- no wait is unbounded: a forward that has run for STUCK_AFTER_MIN seconds, or STUCK_FACTOR
  times the longest forward so far if that is more, opens the gate (that forward may be waiting
  for a lock the paused thread took in a Python call, logging's say). A forward during which the
  gate opened so is not learned from: a stall must not lengthen the next one's bound;
- `begun` counts every forward that began, so the trace function's usual path is one comparison.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from typing import Callable, Iterator

IDLE_AFTER = 0.05      # seconds without a forward before a compile thread goes on
STUCK_AFTER_MIN = 1.0  # seconds a forward runs before a paused compile goes on anyway ...
STUCK_FACTOR = 4.0     # ... or this many times the longest forward so far, if more


class CompileGate:
    def __init__(self):
        self.lock = threading.Lock()  # the counts below; never held by a paused thread
        self.active = 0               # forwards running now, on any thread
        self.begun = 0                # forwards begun so far
        self.since = 0.0              # monotonic: when the oldest running forward began
        self.ended = -math.inf        # monotonic: when the last forward ended
        self.longest = 0.0            # seconds: the longest forward so far, stalled ones left out
        self.stuck = 0                # times a running forward's bound opened the gate
        self.waited = 0.0             # seconds compile threads have waited here

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Held by a forward (any thread): compile threads wait meanwhile and IDLE_AFTER beyond."""
        start = time.monotonic()
        with self.lock:
            if self.active == 0:
                self.since = start
            self.active += 1
            self.begun += 1
            stuck = self.stuck
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1
                self.ended = end = time.monotonic()
                if self.stuck == stuck:
                    self.longest = max(self.longest, end - start)

    def closed_for(self, now: float) -> float:
        """Seconds from `now` until a compile thread may go on (<= 0: it may now)."""
        if self.active:
            return self.since + max(STUCK_AFTER_MIN, STUCK_FACTOR * self.longest) - now
        return self.ended + IDLE_AFTER - now

    def wait_open(self) -> int:
        """Sleeps until the gate opens; returns `begun` as it was when it opened."""
        start = time.monotonic()
        while True:
            begun = self.begun  # read first: a forward begun after it is met at the next call
            now = time.monotonic()
            left = self.closed_for(now)
            if left <= 0:
                self.waited += now - start
                if self.active:
                    self.stuck += 1
                return begun
            time.sleep(min(left, IDLE_AFTER))

    def tracer(self) -> Callable:
        """The trace function of one compile thread (a fresh one per thread). Its first call
        looks at the gate: a compile queued inside a forward must not run beside that forward."""
        seen = -1

        def trace(frame, event, arg):
            nonlocal seen
            if self.begun != seen:
                seen = self.wait_open()
            return None  # no line events
        return trace

    @contextlib.contextmanager
    def paced(self) -> Iterator[None]:
        """The calling thread's Python waits at the gate meanwhile."""
        previous = sys.gettrace()
        sys.settrace(self.tracer())
        try:
            yield
        finally:
            sys.settrace(previous)


GATE = CompileGate()  # one per process: the GIL is the process's
