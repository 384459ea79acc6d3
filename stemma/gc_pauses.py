"""The long-lived heap kept out of Python's full garbage collections, in the processes that
stemma runs.

A full collection (generation 2) scans every object the collector tracks. It holds the GIL, in
whichever thread's allocation set it off, so every other thread waits, a step's included. The
default model's engine tracks some 400k objects once loaded, and more with each decode graph
it compiles (Dynamo's and Inductor's graphs, guards and generated code: 610k after the
one-request graph and the row ops). Serving benchmarks/latency.py's flow, the engine process's
automatic full collections took 107-699 ms each, most while its graphs compiled; one that
lands in a step stalls every running stream at once. vLLM's engine freezes its heap once
started, after its compiles and graph captures; SGLang freezes around its graph captures and on
request (`/freeze_gc`, after warm-up requests). stemma's compiles run after startup, in the
background, so the heap is frozen again after them:

- A settle is a full collection, then `gc.freeze()`. Every survivor moves to the permanent
  generation, which no collection scans again. The collection also records that many objects
  as long-lived, so the next automatic full collection waits until a quarter as many again have
  survived the young generations.
- The process settles once it is ready (`enable`), and after a run of compiles at the next
  moment its loop is idle (`idle`: no request live, no compile running; `compiling` marks the
  compile jobs). It never settles while busy, so it adds no pause to a step; under a load that
  never lets up, Python's own collections run as they would.
- Automatic collections are left as Python makes them. Deferring the full ones while a compile
  ran was tried and dropped: under the soak's constant load a compile waits at the compile gate
  for the whole run, the deferral with it, and the engine's resident size grew 9.8% in 10
  minutes (benchmarks/soak.py: the verdict failed; without the deferral +2.9%, one run each).
- `watch()` times the process's full collections, settles included (`stats`; the engine
  process's info). The engine process watches with or without the rest (`gc_freeze`).

Invariants:
- a frozen object is still freed when its last reference goes, but a cycle among frozen objects
  that becomes garbage later is never collected. So settles are few (startup, and one per run of
  compiles), and the idle ones run when no request is live: a freeze can keep only what was alive
  at one of those few moments;
- nothing changes until `enable()`: an engine in the caller's own process leaves its collector
  alone.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from typing import Iterator

logger = logging.getLogger(__name__)


class GcPauses:
    def __init__(self):
        self.enabled = False
        self.lock = threading.Lock()
        self.compiles = 0            # compile jobs running now
        self.pending = False         # a compile job ran since the last settle
        self.settles = 0
        self.last_ms = 0.0           # the last settle's time
        self.frozen = 0              # objects in the permanent generation after the last settle
        self.full = 0                # full collections seen by `watch`, settles included
        self.full_s = 0.0            # ... their time, summed
        self.full_max_s = 0.0        # ... the longest
        self._began = 0.0

    def watch(self) -> None:
        """Times this process's full collections from now on (`stats`), enabled or not."""
        if self._timed not in gc.callbacks:
            gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = time.perf_counter() - self._began
        self.full += 1
        self.full_s += seconds
        self.full_max_s = max(self.full_max_s, seconds)

    def enable(self) -> None:
        """Settles now (the process is ready), and from now on after each run of compiles."""
        self.enabled = True
        with self.lock:
            self._settle()

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Held by a compile job, on any thread: no settle meanwhile (a freeze would keep its
        temporaries), and one at the next idle moment after it."""
        with self.lock:
            self.compiles += 1
        try:
            yield
        finally:
            with self.lock:
                self.compiles -= 1
                self.pending = True

    def idle(self) -> None:
        """The loop has no live request: settle if a run of compiles ended since the last."""
        if self.enabled and self.pending and not self.compiles:
            with self.lock:
                if self.pending and not self.compiles:
                    self._settle()

    def _settle(self) -> None:
        """Under `lock`, no compile job running."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.pending = False
        self.last_ms = 1e3 * (time.perf_counter() - t0)
        self.settles += 1
        self.frozen = gc.get_freeze_count()
        logger.debug("gc settle #%d: %.1f ms, %d objects frozen", self.settles, self.last_ms, self.frozen)

    def stats(self) -> dict[str, float]:
        return {"gc_settles": self.settles, "gc_settle_ms_last": round(self.last_ms, 1),
                "gc_frozen_objects": self.frozen, "gc_full_collections": self.full,
                "gc_full_ms_total": round(1e3 * self.full_s, 1),
                "gc_full_ms_max": round(1e3 * self.full_max_s, 1)}


GC_PAUSES = GcPauses()  # one per process: the collector is the process's
