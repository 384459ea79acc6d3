"""Noticing that another process has exited: the gateway watches the engine, and every server
process watches its parent so that none outlives the `serve` that started it."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any


class ProcessWatch:
    """Watches a process that need not be our child.

    On Linux `fd` is a pidfd: it turns readable the moment the process exits (even while it is
    an unreaped zombie), so it can sit in a zmq.Poller beside the sockets. Elsewhere `fd` is None
    and `exited()` falls back to probing the pid.
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.fd: int | None = None
        self._gone = False
        if hasattr(os, "pidfd_open"):
            try:
                self.fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone = True

    def exited(self) -> bool:
        if self._gone:
            return True
        if self.fd is not None:
            readable, _, _ = select.select([self.fd], [], [], 0)
            self._gone = bool(readable)
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
        return self._gone

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ParentWatch:
    """True from `orphaned()` once the process that started us has exited (we were reparented)."""

    def __init__(self):
        self.ppid = os.getppid()

    def orphaned(self) -> bool:
        return os.getppid() != self.ppid


def spawn_module(module: str, spec: dict[str, Any]) -> subprocess.Popen:
    """`python -m module`, its spec as JSON on stdin (never on the command line, where a key
    would show in `ps`)."""
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE)
    proc.stdin.write(json.dumps(spec).encode())
    proc.stdin.close()
    return proc


def stop_child(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to a child still running, SIGKILL if it outlives `grace` seconds; reaps it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
