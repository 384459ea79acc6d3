"""The gateway's engine process: started, watched for death and for hangs, and restarted.

    gateway ── Supervisor ── python -m stemma.engine.process   (its spec as JSON on stdin)
                  exit:    its pidfd turns readable; the exit status names the cause
                  hang:    nothing heard from it for engine_timeout s once ready: SIGKILL
                  restart: at most max_restarts in any restart_window s, then give up

The gateway is the engine's parent, so the exit status (a signal, an exit code) is its to read,
and the engine exits by itself when the gateway disappears (it watches its parent). The engine
connects to the gateway's bound sockets, so a fresh engine reaches the same addresses.
Supervision is the server's job: the engine itself is crash-only.
"""
from __future__ import annotations

import collections
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable

from stemma.field_doc import doc
from stemma.serve.proc_watch import ProcessWatch, spawn_module, stop_child

ENGINE_MODULE = "stemma.engine.process"
STOP_GRACE_S = 5.0   # a stopping engine's time to exit before SIGKILL (serve gives the gateway 10)

logger = logging.getLogger("stemma.serve.supervisor")


@dataclass(frozen=True)
class Supervision:
    """What `stemma serve` does when its engine process dies or hangs."""
    no_restart: bool = doc(False, "when the engine process dies, exit (non-zero) instead of "
                                  "restarting it")
    engine_timeout: float = doc(60.0, "seconds without a heartbeat from a ready engine before it "
                                      "is taken for hung, killed and restarted")
    max_restarts: int = doc(3, "engine restarts allowed within --restart-window seconds; one "
                               "more death then stops the server")
    restart_window: float = doc(300.0, "the window (seconds) over which --max-restarts counts")

    def __post_init__(self):
        if not self.engine_timeout > 0:
            raise ValueError(f"engine_timeout must be > 0 seconds, got {self.engine_timeout}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.restart_window > 0:
            raise ValueError(f"restart_window must be > 0 seconds, got {self.restart_window}")


def exit_cause(returncode: int) -> str:
    """What a child's exit status says, in words (a negative status is the signal that killed it)."""
    if returncode >= 0:
        return f"the engine process exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    cause = f"the engine process was killed by signal {-returncode} ({name})"
    if -returncode == signal.SIGKILL:
        cause += " (as the out-of-memory killer does: see the kernel log, dmesg)"
    return cause


class Budget:
    """At most `limit` restarts within any `window` seconds (the times of past restarts, pruned)."""

    def __init__(self, limit: int, window: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self.times: collections.deque[float] = collections.deque()

    def take(self) -> bool:
        """Spends one restart if the window has one left."""
        now = self.clock()
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True

    def __len__(self) -> int:
        return len(self.times)


class Supervisor:
    """One engine process at a time. `spec` is the engine process's JSON spec.

    Invariants: `proc` is the current engine (None before start); `fd` is readable once it has
    exited (it sits in the gateway's poller); `cause` is set, once, when the current engine is
    found dead or hung, and cleared by the next start; the hang clock runs only once the
    current engine is ready (loading a model sends nothing, and may take minutes)."""

    def __init__(self, spec: dict[str, Any], policy: Supervision,
                 clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.policy = policy
        self.clock = clock
        self.budget = Budget(policy.max_restarts, policy.restart_window, clock)
        self.proc: subprocess.Popen | None = None
        self._watch: ProcessWatch | None = None
        self.cause: str | None = None
        self.ready = False
        self.last_heard = 0.0
        self.starts = 0

    @property
    def fd(self) -> int | None:
        return self._watch.fd if self._watch is not None else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self._close_watch()
        self.proc = spawn_module(ENGINE_MODULE, self.spec)
        self._watch = ProcessWatch(self.proc.pid)
        self.cause, self.ready, self.starts = None, False, self.starts + 1
        logger.debug("started the engine process (pid %d)", self.proc.pid)

    def on_ready(self, pid: int | None = None) -> None:
        self.ready = True
        self.last_heard = self.clock()

    def heard(self) -> None:
        """Any frame from the engine: proof that its loop turns."""
        self.last_heard = self.clock()

    def dead(self) -> str | None:
        """Why the current engine no longer serves, once it has exited or hung (a hung one is
        killed and reaped here); None while it lives."""
        if self.cause is not None or self.proc is None:
            return self.cause
        if self.proc.poll() is not None:
            self.cause = exit_cause(self.proc.returncode)
        elif self.ready and self.clock() - self.last_heard > self.policy.engine_timeout:
            silent = self.clock() - self.last_heard
            self.proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            self.proc.wait()
            self.cause = (f"the engine process sent no heartbeat for {silent:.1f} s (the limit is "
                          f"--engine-timeout {self.policy.engine_timeout:g} s): taken for hung "
                          f"and killed")
        return self.cause

    def may_restart(self, last: bool = True) -> tuple[bool, str]:
        """Whether the dead engine may be replaced (spending one restart of the budget), and
        what to tell clients about it (`last`: no other replica serves, so the server stops
        without it)."""
        after = ("the server is going down" if last else
                 "the other replicas go on serving")
        if self.policy.no_restart:
            return False, f"not restarting it (--no-restart); {after}"
        if not self.budget.take():
            return False, (f"not restarting it: it was restarted {len(self.budget)} times in the "
                           f"last {self.policy.restart_window:g} s (--max-restarts); {after}")
        return True, (f"restarting it (restart {len(self.budget)} of {self.policy.max_restarts} "
                      f"in {self.policy.restart_window:g} s); retry shortly")

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL if it outlives `grace`; reaps it."""
        if self.proc is not None:
            stop_child(self.proc, grace)
        self._close_watch()

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
