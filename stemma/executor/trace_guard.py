"""No forward runs while another thread traces a compile.

torch.fx's tracer, under every Inductor compile (AOTAutograd's make_fx traces Dynamo's graph),
patches `torch.nn.Module.__call__` and `__getattr__` for the whole process while it traces. A
module that another thread calls meanwhile runs the tracer's wrapper, not its own forward: a
step beside a background compile failed with "module is not installed as a submodule".

Invariants:
- every trace window (torch.fx's patcher, entered on any thread) holds GUARD;
- a step's forward holds GUARD (`forwarding`), so it waits out a trace window, never a whole
  compile;
- a compile job (`compile_job`) holds COMPILES, and its own forwards (the dummy forwards whose
  first call compiles) do not hold GUARD, or a step would wait for the whole compile. COMPILES
  admits one compile job in the process at a time, so no other job's trace window patches the
  modules under them; a step's forward traces only when Dynamo recompiles inside it, which the
  graphs' guards are made to avoid (sizes dynamic, layouts warmed).
- lock order: COMPILES, then a compile's own locks, then GUARD.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

logger = logging.getLogger(__name__)

GUARD = threading.RLock()     # trace windows and steps' forwards (re-entrant: a trace inside a forward)
COMPILES = threading.RLock()  # compile jobs, one at a time in the process
_installed: bool | None = None
_installing = threading.Lock()
_local = threading.local()    # .jobs: compile jobs this thread is inside


def install() -> bool:
    """Makes torch.fx's trace windows hold GUARD (once per process). False where this torch has
    no patcher to wrap: then a background compile is not safe beside steps."""
    global _installed
    with _installing:
        if _installed is None:
            _installed = _wrap_patcher()
    return _installed


def _wrap_patcher() -> bool:
    from torch.fx import _symbolic_trace as fx_trace
    original = getattr(fx_trace, "_new_patcher", None)
    if original is None:
        logger.warning("torch.fx has no _new_patcher here: a background compile could break the steps "
                       "beside it, so compiles will wait for the steps and the steps for them")
        return False

    @contextlib.contextmanager
    def guarded_patcher() -> Iterator:
        with GUARD, original() as patcher:
            yield patcher

    fx_trace._new_patcher = guarded_patcher
    return True


@contextlib.contextmanager
def compile_job() -> Iterator[None]:
    """Held by a compile job, on whichever thread runs it. Where the trace windows cannot hold
    GUARD (`install` False), the whole job holds it: the steps then wait for the compile."""
    with COMPILES, (contextlib.nullcontext() if install() else GUARD):
        _local.jobs = getattr(_local, "jobs", 0) + 1
        try:
            yield
        finally:
            _local.jobs -= 1


@contextlib.contextmanager
def forwarding() -> Iterator[None]:
    """Held by a forward: GUARD, unless this thread is inside a compile job (see the invariants)."""
    if getattr(_local, "jobs", 0):
        yield
        return
    with GUARD:
        yield
