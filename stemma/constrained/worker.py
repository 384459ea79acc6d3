"""A build worker that a stuck build cannot hold: one daemon thread runs the jobs in order, and
`abandon()` hands the queue to a fresh thread, leaving the stuck job to finish (or not) alone.

A compile inside outlines-core or llguidance is Rust code that cannot be interrupted from Python,
so a pathological regex, schema or grammar may run for minutes. The scheduler ends its request at
the timeout (EngineConfig.constraint_timeout_s) and abandons the worker: the thread that runs it
stops taking jobs once that job returns (it sets its Future then, which nobody reads), and the
jobs behind it run on a new thread at once. What stays running is that one compile, on a daemon
thread (it never delays the process's exit), with the CPU time and memory it takes.

Invariant: each job runs exactly once, on the thread of the generation that took it; a thread
whose generation is not the current one takes no more jobs.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

IDLE_EXIT_S = 30.0  # an idle thread exits after this long (the next submit starts another)


class Worker:
    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._generation = 0
        self._thread_alive = False   # a thread of the current generation is running
        self._busy = False           # it is inside a job
        self.abandoned = 0           # threads left to a stuck job

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._cond:
            self._jobs.append((future, fn, args))
            self._ensure_thread()
            self._cond.notify()
        return future

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._busy

    def abandon(self) -> None:
        """Leaves the running job (if any) to its thread; queued jobs go to a fresh thread."""
        with self._cond:
            if not self._busy:
                return
            self._generation += 1
            self.abandoned += 1
            self._thread_alive = self._busy = False
            if self._jobs:
                self._ensure_thread()
            self._cond.notify_all()

    def _ensure_thread(self) -> None:  # under the lock
        if not self._thread_alive:
            self._thread_alive = True
            threading.Thread(target=self._run, args=(self._generation,), daemon=True,
                             name=f"{self.name}-{self._generation}").start()

    def _run(self, generation: int) -> None:
        while True:
            with self._cond:
                while generation == self._generation and not self._jobs:
                    if not self._cond.wait(IDLE_EXIT_S) and not self._jobs:
                        if generation == self._generation:
                            self._thread_alive = False
                        return
                if generation != self._generation:
                    return
                future, fn, args = self._jobs.popleft()
                self._busy = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the job's error is its Future's
                    future.set_exception(exc)
            with self._cond:
                if generation != self._generation:
                    return  # abandoned while in the job: the fresh thread has the queue
                self._busy = False
