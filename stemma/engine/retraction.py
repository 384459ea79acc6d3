"""Retraction: when the KV pool runs dry, the running request with the least progress gives back
its slots and waits to be recomputed. Its computed KV goes to the radix tree first, so its prefix
is likely still cached when it is admitted again. Nothing is dropped."""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

from stemma.engine.request import ReqState

if TYPE_CHECKING:
    from stemma.cache.radix_cache import RadixCache
    from stemma.cache.kv_pool import ReqToSlot
    from stemma.engine.counters import Counters
    from stemma.engine.request import Request


class Retraction:
    def __init__(self, running: list[Request], waiting: deque[Request], cache: RadixCache,
                 req_to_slot: ReqToSlot, release: Callable[[Request], None], counters: Counters):
        self.running = running
        self.waiting = waiting
        self.cache = cache
        self.req_to_slot = req_to_slot
        self.release = release
        self.counters = counters
        self.scheduled: set[int] = set()  # ids of requests holding slots for this step: never victims

    def begin_step(self) -> None:
        """A new step: nothing holds slots for it yet."""
        self.scheduled = set()

    def room(self) -> int:
        """Slots that can be had without retracting: free ones plus evictable cached ones."""
        return self.cache.allocator.available + self.cache.evictable_size

    def ensure_decode_slots(self, n: int) -> None:
        """Retracts the least advanced running requests until n decode slots can be had (a
        retracted decoding request needs one slot fewer)."""
        while n and self.room() < n:
            victim = self.pick_victim()
            if victim is None:
                return
            n -= 1 if victim.is_decoding else 0
            self.retract(victim)

    def alloc_into(self, req: Request, n: int) -> bool:
        """Allocates n slots at positions [kv_len, kv_len + n) of req's row, retracting requests
        not yet scheduled this step when the pool is short: req itself last among those of its
        priority or lower, and before any of higher priority. False: req was retracted."""
        while True:
            slots = self.cache.alloc(n)
            if slots is not None:
                self.req_to_slot.write(req.row, req.kv_len, slots)
                return True
            victim = self.pick_victim(exclude=req)
            if victim is None or req.params.priority < victim.params.priority:
                victim = req  # the one asking gives way to a request of higher priority
            self.retract(victim)
            if victim is req:
                return False

    def pick_victim(self, exclude: Request | None = None) -> Request | None:
        """The running request that holds no slots for this step and gives way first: the lowest
        priority, then the least progress, then the latest arrival (as slo.victims orders them)."""
        candidates = [r for r in self.running if r is not exclude and id(r) not in self.scheduled]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.params.priority, len(r.output_ids), -r.arrival))

    def retract(self, req: Request) -> None:
        self.release(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        if not req.prompt_logprobs_done:  # partly scored: recomputed with the prompt; once whole
            req.prompt_logprobs.clear()    # they stand, and its cached prefix is reused whole
        self.counters.retractions += 1
        self.waiting.appendleft(req)
