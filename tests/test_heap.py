"""The engine process's heap trimmer: when it calls malloc_trim, and that the real call gives
freed memory back."""
from __future__ import annotations

import sys

import pytest

from stemma.engine.heap import HeapTrimmer, _malloc_trim
from stemma.engine_config import EngineConfig


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trimmer(interval_s: float) -> tuple[HeapTrimmer, Clock, list[int]]:
    clock, calls = Clock(), []
    return HeapTrimmer(interval_s, clock=clock, trim=lambda pad: calls.append(pad) or 1), clock, calls


def test_busy_trims_once_per_interval():
    heap, clock, calls = trimmer(5.0)
    for _ in range(10):          # steps within the first interval: no trim
        clock.now += 0.4
        heap.worked()
    assert calls == []
    clock.now = 5.0
    heap.worked()
    assert calls == [0]
    clock.now = 9.9
    heap.worked()
    assert calls == [0]          # the interval counts from the last trim
    clock.now = 10.0
    heap.worked()
    assert calls == [0, 0] and heap.calls == 2


def test_idle_trims_once_after_work_and_never_without_it():
    heap, clock, calls = trimmer(5.0)
    heap.idle()
    assert calls == []           # nothing ran yet
    clock.now = 1.0
    heap.worked()
    heap.idle()
    heap.idle()
    assert calls == [0]          # once per fall into idle, however long the idle loop turns
    clock.now = 7.0
    heap.worked()                # 6 s since the idle trim: trims while busy
    heap.idle()                  # nothing ran since that trim
    assert calls == [0, 0]


def test_interval_zero_turns_it_off():
    heap, clock, calls = trimmer(0.0)
    clock.now = 100.0
    heap.worked()
    heap.idle()
    assert calls == [] and not heap.enabled


def test_config_field():
    assert EngineConfig().heap_trim_interval_s == 5.0
    assert EngineConfig(heap_trim_interval_s=0).heap_trim_interval_s == 0
    with pytest.raises(ValueError, match="heap_trim_interval_s"):
        EngineConfig(heap_trim_interval_s=-1)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None,
                    reason="glibc's malloc_trim")
def test_malloc_trim_gives_fragmented_free_memory_back():
    """Blocks under glibc's mmap threshold live in the heap; freeing every other one leaves holes
    that free() keeps, and malloc_trim hands their pages back."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 2000  # 125 MiB in 64 KiB blocks
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touched: resident
    for b in blocks[::2]:
        libc.free(b)
    before = _rss_kib()
    heap = HeapTrimmer(1.0)
    heap.worked()
    heap.idle()
    after = _rss_kib()
    for b in blocks[1::2]:
        libc.free(b)
    assert heap.calls == 1
    assert before - after > 40 * 1024, (before, after)  # most of the 62 MiB of holes went back
