"""A torch.fx trace window patches for its own thread only, so a step beside a compile runs its own modules.

torch.fx's tracer, under every Inductor compile (AOTAutograd's make_fx traces Dynamo's graph),
patches `torch.nn.Module.__call__` and `__getattr__` (and some global functions) for the whole
process while it traces. A module that another thread called meanwhile ran the tracer's wrapper,
not its own forward: a step beside a background compile failed with "module is not installed as
a submodule". A step that waited for the window instead stalled for as long as the window lasts
(4-7 s for the default model's decode graph).

Invariants:
- every trace window (torch.fx's patcher, entered on any thread) installs its patches wrapped:
  on the thread that entered it they run the tracer's function, on any other thread the one
  they replaced. So a step's forward neither waits for a window nor sees its patches;
- a compile job (`compile_job`) holds COMPILES: one compile job in the process at a time, as
  torch.fx keeps one current patcher per process. A step's forward traces only when Dynamo
  recompiles inside it, which the graphs' guards are made to avoid (sizes dynamic, layouts
  warmed);
- where this torch has no patcher to wrap (`install` False), a compile job holds GUARD for its
  whole length and every forward holds GUARD (`forwarding`): the steps then wait for the compile;
- lock order: COMPILES, then a compile's own locks, then GUARD.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import threading
from typing import Any, Callable, Iterator

from stemma.gc_pauses import GC_PAUSES

logger = logging.getLogger(__name__)

GUARD = threading.RLock()     # (no wrappable patcher) compile jobs and forwards
COMPILES = threading.RLock()  # compile jobs, one at a time in the process
_installed: bool | None = None
_installing = threading.Lock()
_local = threading.local()    # .jobs: compile jobs this thread is inside


def install() -> bool:
    """Makes torch.fx's trace windows patch for their own thread only (once per process). False
    where this torch has no patcher to wrap: then a background compile is not safe beside steps."""
    global _installed
    with _installing:
        if _installed is None:
            _installed = _wrap_patcher()
    return _installed


def _wrap_patcher() -> bool:
    from torch.fx import _symbolic_trace as fx_trace
    original = getattr(fx_trace, "_new_patcher", None)
    if original is None or not all(hasattr(getattr(fx_trace, "_Patcher", None), m) for m in ("patch", "patch_method")):
        logger.warning("torch.fx has no patcher to wrap here: a background compile could break the steps "
                       "beside it, so compiles will wait for the steps and the steps for them")
        return False

    @contextlib.contextmanager
    def own_thread_patcher() -> Iterator:
        with original() as patcher:
            _patch_for_this_thread(patcher)
            yield patcher

    fx_trace._new_patcher = own_thread_patcher
    return True


def _patch_for_this_thread(patcher) -> None:
    """Makes `patcher` install each patch wrapped by `_on_thread` for the calling thread."""
    owner = threading.get_ident()
    patch, patch_method = patcher.patch, patcher.patch_method

    def patch_here(frame_dict: dict, name: str, new_fn: Callable, deduplicate: bool = True) -> None:
        replaced = frame_dict[name] if name in frame_dict or not hasattr(builtins, name) else getattr(builtins, name)
        patch(frame_dict, name, _on_thread(owner, new_fn, replaced), deduplicate)

    def patch_method_here(cls: type, name: str, new_fn: Callable, deduplicate: bool = True) -> None:
        patch_method(cls, name, _on_thread(owner, new_fn, getattr(cls, name)), deduplicate)

    patcher.patch, patcher.patch_method = patch_here, patch_method_here


def _on_thread(owner: int, new_fn: Callable, replaced: Callable) -> Callable:
    """`new_fn` on thread `owner`, `replaced` on every other."""
    def either(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            return new_fn(*args, **kwargs)
        return replaced(*args, **kwargs)
    return either


@contextlib.contextmanager
def compile_job() -> Iterator[None]:
    """Held by a compile job, on whichever thread runs it. Where the trace windows cannot hold
    GUARD (`install` False), the whole job holds it: the steps then wait for the compile. No
    heap freeze meanwhile; one at the next idle moment after it (`stemma.gc_pauses`)."""
    with COMPILES, GC_PAUSES.compiling(), (contextlib.nullcontext() if install() else GUARD):
        _local.jobs = getattr(_local, "jobs", 0) + 1
        try:
            yield
        finally:
            _local.jobs -= 1


@contextlib.contextmanager
def forwarding() -> Iterator[None]:
    """Held by a forward: nothing where the windows patch for their own thread; else GUARD,
    unless this thread is inside a compile job (whose own forwards must not wait for it)."""
    if _installed or getattr(_local, "jobs", 0):
        yield
        return
    with GUARD:
        yield
