"""stemma.gc_pauses: settles freeze the long-lived heap, a compile's results are frozen at the
next idle moment after it (never while one runs), and nothing changes until a process enables
it."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest

from stemma.gc_pauses import GcPauses


@pytest.fixture(autouse=True)
def collector():
    """Each test leaves the collector as it found it: nothing frozen."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self):
        self.me = self


def tracked(obj) -> bool:
    """Whether a collection would scan `obj` (the permanent generation is not listed)."""
    return any(o is obj for o in gc.get_objects())


def test_nothing_changes_until_enabled():
    pauses, before = GcPauses(), gc.get_threshold()
    with pauses.compiling():
        assert gc.get_threshold() == before
    pauses.idle()
    assert gc.get_freeze_count() == 0 and pauses.settles == 0


def test_enable_freezes_what_lives_and_collects_what_does_not():
    kept, dropped = [Cycle()], Cycle()
    gone = weakref.ref(dropped)
    del dropped
    pauses = GcPauses()
    pauses.enable()
    assert gone() is None  # garbage is collected, not frozen
    assert gc.get_freeze_count() > 0 and pauses.frozen > 0
    assert not tracked(kept) and gc.is_tracked(kept)
    assert pauses.settles == 1


def test_a_compiles_results_are_frozen_at_the_next_idle_moment():
    pauses, before = GcPauses(), gc.get_threshold()
    pauses.enable()
    with pauses.compiling():
        made = [Cycle() for _ in range(10)]
    assert gc.get_threshold() == before  # Python's own collections, untouched
    assert pauses.pending and pauses.settles == 1 and tracked(made)
    pauses.idle()
    assert pauses.settles == 2 and not pauses.pending
    assert not tracked(made)  # the compile's long-lived results are frozen
    pauses.idle()
    assert pauses.settles == 2  # nothing compiled since


def test_no_settle_while_any_compile_runs():
    pauses = GcPauses()
    pauses.enable()
    with pauses.compiling():
        with pauses.compiling():  # a compile job inside the compile thread's run
            pass
        pauses.idle()
        assert pauses.settles == 1 and pauses.pending
    pauses.idle()
    assert pauses.settles == 2


def test_a_compile_on_another_thread_is_waited_for():
    pauses = GcPauses()
    pauses.enable()
    inside, release = threading.Event(), threading.Event()

    def compile_job():
        with pauses.compiling():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=compile_job)
    thread.start()
    assert inside.wait(10)
    pauses.idle()
    assert pauses.settles == 1
    release.set()
    thread.join(10)
    pauses.idle()
    assert pauses.settles == 2


def test_every_compile_job_marks_a_run_of_compiles(monkeypatch):
    """The wiring: executor.trace_guard.compile_job, held by every compile (decode graphs and
    row ops, background or in a step), holds the process's GC_PAUSES.compiling()."""
    from stemma.executor.trace_guard import compile_job
    from stemma.gc_pauses import GC_PAUSES
    monkeypatch.setattr(GC_PAUSES, "enabled", True)
    monkeypatch.setattr(GC_PAUSES, "pending", False)
    with compile_job():
        assert GC_PAUSES.compiles == 1
    assert GC_PAUSES.pending and GC_PAUSES.compiles == 0
    GC_PAUSES.idle()
    assert not GC_PAUSES.pending


def test_watch_times_full_collections_settles_included():
    pauses = GcPauses()
    pauses.watch()
    pauses.watch()  # once only
    try:
        gc.collect(1)
        assert pauses.full == 0
        gc.collect()
        pauses.enable()
        stats = pauses.stats()
        assert pauses.full == 2 and stats["gc_full_collections"] == 2 and stats["gc_settles"] == 1
        assert 0 < stats["gc_full_ms_max"] <= stats["gc_full_ms_total"]
    finally:
        gc.callbacks.remove(pauses._timed)
