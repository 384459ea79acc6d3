"""Admission: which waiting requests join the batch this step, within the prefill token budget,
keeping KV in reserve for the decodes of the requests already running.

One `Admission` lives for one step. Running requests still prefilling (chunked prompts, or tokens
forced by jump-forward) take their chunks from the budget first; then waiting requests are
admitted in policy order until the budget, the KV room or the running-request limit runs out.
"""
from __future__ import annotations

import time

from typing import TYPE_CHECKING

from stemma.engine.request import ReqState

if TYPE_CHECKING:
    from stemma.cache.kv_pool import ReqToSlot
    from stemma.cache.radix_cache import RadixCache
    from stemma.engine.counters import Counters
    from stemma.engine.prefix_match import PrefixMatches
    from stemma.engine.request import Request
    from stemma.engine.retraction import Retraction
    from stemma.engine_config import EngineConfig

RESERVE_CLIP = 512  # remaining tokens counted per running request when reserving KV


def prefill_budget(config: EngineConfig) -> int:
    """Prefill tokens one step may run: the chunk size when prompts are chunked, capped by
    max_prefill_tokens."""
    chunk = config.chunk_size
    return min(chunk, config.max_prefill_tokens) if chunk else config.max_prefill_tokens


def reserve_for(running: list[Request], extra: Request, ratio: float) -> int:
    """KV kept free for the decodes of the running requests (and `extra`), when any run."""
    if not running:
        return 0
    return int(sum(min(r.remaining_new_tokens, RESERVE_CLIP) for r in running + [extra]) * ratio)


class Admission:
    def __init__(self, config: EngineConfig, cache: RadixCache, req_to_slot: ReqToSlot,
                 running: list[Request], matches: PrefixMatches, retraction: Retraction,
                 counters: Counters):
        self.config = config
        self.cache = cache
        self.req_to_slot = req_to_slot
        self.running = running
        self.matches = matches
        self.retraction = retraction
        self.counters = counters
        self.full_budget = prefill_budget(config)
        self.budget = self.full_budget  # prefill tokens left this step

    def chunk(self, extend: int) -> int:
        """How many of `extend` new tokens fit this step's remaining budget. Chunked: as many as
        fit. Unchunked: all of them or none, except that the step's first prefill always fits."""
        if self.config.chunk_size:
            return min(extend, self.budget) if self.budget > 0 else 0
        return extend if self.budget >= extend or self.budget == self.full_budget else 0

    def take(self, n: int) -> None:
        self.budget -= n

    def reserve(self, extra: Request) -> int:
        """KV kept free for the decodes of the running requests (and `extra`)."""
        return reserve_for(self.running, extra, self.config.kv_reserve_ratio)

    def admit(self, req: Request, enforce_reserve: bool) -> int | None:
        """Admits req into running with a row and its cached prefix; returns the tokens it
        extends this step (0 when the budget is spent), or None when it cannot be admitted."""
        slots, node = self.matches.get(req)
        extend = len(req.tokens) - len(slots)
        n = self.chunk(extend)
        if n == 0 and self.config.batching == "continuous":
            return None
        self.cache.lock(node)
        reserve = self.reserve(req) if enforce_reserve else 0
        if n + reserve > self.retraction.room() or self.req_to_slot.available == 0:
            self.cache.unlock(node)
            return None
        new_slots = self.cache.alloc(n)
        if new_slots is None:
            self.cache.unlock(node)
            return None
        row = self.req_to_slot.alloc_row()
        self.req_to_slot.write(row, 0, slots)
        self.req_to_slot.write(row, len(slots), new_slots)
        req.row, req.node, req.kv_len = row, node, len(slots)
        if not req.admitted_once:
            req.cached_tokens = len(slots)
            self.counters.prompt_tokens += len(req.input_ids)
            self.counters.cached_tokens += len(slots)
            if len(slots):  # it reuses the cached prefix ending at node: a hit along its path
                self.cache.record_hit(node, req.program)
            req.admitted_once = True
            req.admit_time = time.perf_counter()
        req.state = ReqState.RUNNING
        self.running.append(req)
        return n
