"""The iteration-level scheduler: once per model step it decides which tokens to process.

    step():  take in new requests
             -> order the waiting queue by policy
             -> running requests first: decodes (one slot each), then unfinished prefills
             -> admit waiting requests within the prefill token budget and the chunk size,
                keeping a KV reserve for the running decodes
             -> one forward over the mixed batch
             -> sample, check stops, and release finished requests at once

When the pool runs dry, the running request with the least progress is retracted: its computed
KV goes to the radix tree (so its prefix is likely still cached) and it waits to be recomputed.
Nothing is dropped.

Constrained requests (regex / json_schema / grammar) first wait in the grammar queue, outside the
batch, while their Index builds on a background thread; the batch never waits for them. Once in
the batch, only their rows are masked, and jump-forward may append forced tokens after a sample,
which the next step extends like a chunk of prefill (see stemma.constrained).
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from stemma.cache.radix_cache import RadixCache
from stemma.engine import policy
from stemma.constrained.constrainer import Constrainer
from stemma.engine_config import EngineConfig
from stemma.executor.forward_batch import ForwardBatch
from stemma.executor.runner import ModelRunner
from stemma.engine.request import ReqState, Request
from stemma.sampling.sampler import Sampler, row_major_float
from stemma.sampling.batch import SamplingBatch
from stemma.engine.stop import check_finish

_RESERVE_CLIP = 512  # remaining tokens counted per running request when reserving KV
_SHARED_PREFIX_TOKENS = 16  # in-batch prefix sharing: defer a request sharing this many new tokens


@dataclass
class Counters:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    busy_time: float = 0.0


class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, eos_token_ids: tuple[int, ...],
                 tokenizer=None):
        self.runner = runner
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.cache = RadixCache(runner.pool.allocator, runner.req_to_slot, config.enable_radix_cache)
        generator = None
        if config.random_seed is not None:
            generator = torch.Generator(device=runner.device).manual_seed(config.random_seed)
        self.sampler = Sampler(generator)
        self.constrainer = Constrainer(tokenizer, runner.spec.vocab_size, eos_token_ids,
                                       config.enable_jump_forward, config.constraint_cache_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.grammar_queue: list[tuple[Request, Future]] = []  # constrained, guide being built
        self.counters = Counters()
        self.max_context = runner.max_context

    # ---- queue ----
    def add(self, req: Request) -> None:
        """Queues req; a ValueError (too long, or a bad regex/json_schema/grammar) queues nothing."""
        if len(req.tokens) >= self.max_context:
            raise ValueError(f"prompt of {len(req.tokens)} tokens does not fit the context of "
                             f"{self.max_context} tokens")
        spec = self.constrainer.check(req.params) if req.params.is_constrained else None
        req.state = ReqState.WAITING
        if spec is None:
            self.waiting.append(req)
        else:
            self.grammar_queue.append((req, self.constrainer.start(spec)))

    def _take_built(self) -> list[Request]:
        """Moves constrained requests whose guide is built to the waiting queue; finishes (with
        reason "error" and req.error) those whose build failed. Returns the finished ones."""
        failed, pending = [], []
        for req, future in self.grammar_queue:
            if not future.done():
                pending.append((req, future))
                continue
            try:
                req.constraint = future.result()()
            except Exception as exc:  # a build failure ends this request only; it is reported
                req.error = f"{type(exc).__name__}: {exc}"
                failed.append(self._finish(req, "error"))
                continue
            self.waiting.append(req)
        self.grammar_queue = pending
        return failed

    def abort(self, rid: str) -> Request | None:
        for i, (req, _) in enumerate(self.grammar_queue):
            if req.rid == rid:
                del self.grammar_queue[i]
                return self._finish(req, "abort")
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish(req, "abort")
        for req in self.running:
            if req.rid == rid:
                return self._finish(req, "abort")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_queue)

    # ---- one step ----
    def step(self) -> list[Request]:
        """Runs one forward if there is work; returns the requests that got output or finished."""
        start = time.perf_counter()
        failed = self._take_built() if self.grammar_queue else []
        batch = self._schedule()
        if not batch:
            return failed
        reqs, counts = zip(*batch)
        fb = self._build(reqs, counts)
        logits = self.runner.forward(fb)
        touched = self._process(list(reqs), list(counts), fb, logits)
        self.counters.steps += 1
        self.counters.busy_time += time.perf_counter() - start
        return failed + touched

    # ---- scheduling ----
    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, number of new tokens) for this step, with their slots allocated."""
        batch = self._schedule_running()
        budget = self._prefill_budget() - sum(n for r, n in batch if not r.is_decoding)
        if self._may_admit():
            batch += self._admit(budget)
        return batch

    def _may_admit(self) -> bool:
        mode = self.config.batching
        if not self.waiting:
            return False
        if mode == "continuous":
            return True
        if self.running:
            return False
        if mode == "dynamic":
            full = len(self.waiting) >= self.config.max_running_requests
            waited = time.perf_counter() - self.waiting[0].arrival
            return full or waited * 1000.0 >= self.config.dynamic_wait_ms
        return True

    def _prefill_budget(self) -> int:
        chunk = self.config.chunk_size
        return min(chunk, self.config.max_prefill_tokens) if chunk else self.config.max_prefill_tokens

    def _schedule_running(self) -> list[tuple[Request, int]]:
        self._scheduled: set[int] = set()
        self._ensure_slots(sum(1 for r in self.running if r.is_decoding))
        decodes = [r for r in self.running if r.is_decoding]
        batch = []
        if decodes:
            slots = self.cache.alloc(len(decodes))
            if slots is None:
                raise RuntimeError("KV pool cannot hold one more token per running request")
            rows = torch.tensor([r.row for r in decodes], dtype=torch.int64)
            cols = torch.tensor([r.kv_len for r in decodes], dtype=torch.int64)
            self.runner.req_to_slot.table[rows, cols] = slots.to(torch.int32)
            batch = [(r, 1) for r in decodes]
            self._scheduled.update(id(r) for r in decodes)
        budget = self._prefill_budget()
        for req in [r for r in self.running if not r.is_decoding]:
            n = self._chunk(req.extend_len, budget)
            if n == 0 or not self._alloc_into(req, n):
                continue  # no budget left, or retracted back to the waiting queue
            budget -= n
            batch.append((req, n))
            self._scheduled.add(id(req))
        return batch

    def _chunk(self, extend: int, budget: int) -> int:
        if self.config.chunk_size:
            return min(extend, budget) if budget > 0 else 0
        return extend if budget >= extend or budget == self._prefill_budget() else 0

    def _room(self) -> int:
        return self.cache.allocator.available + self.cache.evictable_size

    def _ensure_slots(self, n: int) -> None:
        """Retracts the least advanced running requests until n decode slots can be had."""
        while n and self._room() < n:
            victim = self._pick_victim()
            if victim is None:
                return
            n -= 1 if victim.is_decoding else 0
            self._retract(victim)

    def _alloc_into(self, req: Request, n: int) -> bool:
        """Allocates n slots at positions [kv_len, kv_len + n) of req's row, retracting requests
        not yet scheduled this step (req itself last) when the pool is short."""
        while True:
            slots = self.cache.alloc(n)
            if slots is not None:
                self.runner.req_to_slot.write(req.row, req.kv_len, slots)
                return True
            victim = self._pick_victim(exclude=req) or req
            self._retract(victim)
            if victim is req:
                return False

    def _pick_victim(self, exclude: Request | None = None) -> Request | None:
        """The running request with the least progress that holds no slots for this step."""
        candidates = [r for r in self.running if r is not exclude and id(r) not in self._scheduled]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (len(r.output_ids), -r.arrival))

    def _retract(self, req: Request) -> None:
        self._release(req)
        req.state = ReqState.WAITING
        req.retractions += 1
        req.prompt_logprobs.clear()  # recomputed with the prompt
        req.prompt_logprobs_done = False
        self.counters.retractions += 1
        self.waiting.appendleft(req)

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        ordered = policy.order(self.waiting, self.config.schedule_policy, self._match_len,
                               self.config.lpm_fallback_queue)
        continuous = self.config.batching == "continuous"
        # requests whose prompt KV is being computed now; a waiting request that shares a long
        # uncached prefix with one of them waits a step and then reads that prefix from the cache
        computing = [r for r in self.running if r.kv_len < len(r.input_ids)]
        admitted = []
        for req in ordered:
            if len(self.running) >= self.config.max_running_requests:
                break
            if continuous and self._shares_uncached_prefix(req, computing):
                continue
            n = self._admit_one(req, budget, enforce_reserve=continuous)
            if n is None:
                if continuous:
                    break
                continue
            self.waiting.remove(req)
            budget -= n
            computing.append(req)
            if n:
                admitted.append((req, n))
        return admitted

    def _shares_uncached_prefix(self, req: Request, computing: list[Request]) -> bool:
        if not self.cache.enabled or not computing:
            return False
        start = self._match_len(req)[0]
        end = start + _SHARED_PREFIX_TOKENS
        if end > len(req.tokens):
            return False
        window = req.tokens[start:end]
        return any(r.salt == req.salt and r.tokens[start:end] == window for r in computing)

    def _match_len(self, req: Request) -> tuple[int, object]:
        slots, node = self.cache.match(req.tokens[:self._match_cap(req)], req.salt)
        return len(slots), node

    def _match_cap(self, req: Request) -> int:
        cap = len(req.tokens) - 1
        start = req.logit_start()
        return cap if start is None else min(cap, start)

    def _reserve(self, extra: Request) -> int:
        """KV kept free for the decodes of the running requests (and `extra`)."""
        if not self.running:
            return 0
        total = sum(min(r.remaining_new_tokens, _RESERVE_CLIP) for r in self.running + [extra])
        return int(total * self.config.kv_reserve_ratio)

    def _admit_one(self, req: Request, budget: int, enforce_reserve: bool) -> int | None:
        """Admits req into running with a row and its cached prefix; returns the tokens it
        extends this step (0 when the budget is spent), or None when it cannot be admitted."""
        slots, node = self.cache.match(req.tokens[:self._match_cap(req)], req.salt)
        extend = len(req.tokens) - len(slots)
        n = self._chunk(extend, budget)
        if n == 0 and self.config.batching == "continuous":
            return None
        self.cache.lock(node)
        reserve = self._reserve(req) if enforce_reserve else 0
        if n + reserve > self._room() or self.runner.req_to_slot.available == 0:
            self.cache.unlock(node)
            return None
        new_slots = self.cache.alloc(n)
        if new_slots is None:
            self.cache.unlock(node)
            return None
        row = self.runner.req_to_slot.alloc_row()
        self.runner.req_to_slot.write(row, 0, slots)
        self.runner.req_to_slot.write(row, len(slots), new_slots)
        req.row, req.node, req.kv_len = row, node, len(slots)
        if not req.admitted_once:
            req.cached_tokens = len(slots)
            self.counters.prompt_tokens += len(req.input_ids)
            self.counters.cached_tokens += len(slots)
            req.admitted_once = True
        req.state = ReqState.RUNNING
        self.running.append(req)
        return n

    # ---- forward ----
    def _build(self, reqs, counts):
        token_lists = [r.tokens[r.kv_len:r.kv_len + n] for r, n in zip(reqs, counts)]
        out_slots = torch.cat([self.runner.req_to_slot.read(r.row, r.kv_len + n, r.kv_len)
                               for r, n in zip(reqs, counts)])
        return ForwardBatch.build(token_lists=token_lists, req_rows=[r.row for r in reqs],
                                  prefix_lens=[r.kv_len for r in reqs], out_slots=out_slots,
                                  req_to_slot=self.runner.req_to_slot.table,
                                  logit_starts=[r.logit_start() for r in reqs])

    # ---- after the forward ----
    def _process(self, reqs, counts, fb, logits) -> list[Request]:
        ends = torch.tensor(fb.logits_counts).cumsum(0).tolist()  # request i's rows end at ends[i]
        sampling, rows = [], []
        for i, (req, n) in enumerate(zip(reqs, counts)):
            if req.logit_start() is not None:
                self._record_prompt_logprobs(req, n, logits[ends[i] - fb.logits_counts[i]:ends[i]])
            req.kv_len += n
            if req.kv_len < len(req.tokens):
                req.node, _ = self.cache.cache_unfinished(req.row, req.tokens[:req.kv_len], req.salt, req.node)
                continue
            if req.params.max_new_tokens == 0:
                self._finish(req, "length")
                continue
            sampling.append(req)
            rows.append(ends[i] - 1)
        if sampling:
            if len(rows) != logits.shape[0]:
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            self._sample(sampling, logits)
        return list(reqs)

    def _record_prompt_logprobs(self, req: Request, n: int, lg: torch.Tensor) -> None:
        """Logprobs of the prompt tokens whose preceding position is among lg's rows."""
        first = req.kv_len + n - lg.shape[0]          # position of lg[0]
        prompt_end = len(req.input_ids) - 1           # last position whose next token is in the prompt
        if first <= prompt_end:
            upto = min(req.kv_len + n, prompt_end + 1) - first
            targets = torch.tensor(req.tokens[first + 1:first + 1 + upto], dtype=torch.int64)
            lp = torch.log_softmax(row_major_float(lg[:upto]), dim=-1).gather(1, targets[:, None])[:, 0]
            if not req.prompt_logprobs and req.params.logprob_start == 0:
                req.prompt_logprobs.append(None)  # the first token has no context
            req.prompt_logprobs.extend(lp.tolist())
        if req.kv_len + n >= len(req.input_ids):
            req.prompt_logprobs_done = True

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        # constrained rows only: one bitmask, applied in place; unconstrained rows are not touched
        guided = [i for i, r in enumerate(reqs) if r.constraint is not None]
        if guided:
            self.constrainer.mask(logits, [reqs[i].constraint for i in guided], guided)
        batch = SamplingBatch.build(reqs, logits.shape[-1], logits.device, eos_token_ids=self.eos_token_ids)
        out = self.sampler.sample(logits, batch)
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        tops = out.top_logprobs
        now = time.perf_counter()
        newly_prompt_done = []
        for i, (req, sampled) in enumerate(zip(reqs, tokens)):
            first = not req.output_ids
            # a constrained request may end here, or append forced tokens (jump-forward) in place of
            # the sampled one; a request asking for logprobs is never jump-forwarded
            news, reason = ([sampled], None) if req.constraint is None else self.constrainer.advance(req, sampled)
            if req.first_token_time is None:
                req.first_token_time = now
            for j, tok in enumerate(news):
                req.append(tok)
                self.counters.generated_tokens += 1
                if lps is not None and req.params.logprobs:
                    req.output_logprobs.append(lps[i])
                if tops is not None and req.params.top_logprobs:
                    k = req.params.top_logprobs
                    req.output_top_logprobs.append(list(zip(tops.ids[i, :k].tolist(), tops.values[i, :k].tolist())))
                stop = check_finish(req, tok, self.eos_token_ids, self.max_context, self.tokenizer)
                if stop is not None:  # the constraint's own end wins on its last token
                    reason = reason if reason is not None and j == len(news) - 1 else stop
                    break
            if reason is not None:
                self._finish(req, reason)
            elif first:
                newly_prompt_done.append(req)
        for req in newly_prompt_done:  # share the prompt with siblings and later requests now
            req.node, _ = self.cache.cache_unfinished(req.row, req.tokens[:req.kv_len], req.salt, req.node)

    # ---- release ----
    def _release(self, req: Request) -> None:
        """Gives back the request's row and KV; computed KV goes to the radix tree."""
        if req.row is None:
            return
        self.cache.cache_finished(req.row, req.tokens[:req.kv_len], req.salt, req.node)
        self.runner.req_to_slot.free_row(req.row)
        self.running.remove(req)
        req.row, req.node, req.kv_len = None, None, 0

    def _finish(self, req: Request, reason: str) -> Request:
        self._release(req)
        req.constraint = None
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        return req

    # ---- invariants and stats ----
    def held_by_requests(self) -> int:
        """Slots running requests own between steps: positions [node.depth, kv_len) of their rows."""
        return sum(r.kv_len - r.node.depth for r in self.running)

    def check_pool_whole(self) -> None:
        self.cache.check_pool_whole(self.held_by_requests())

    def flush_cache(self) -> bool:
        if self.running:
            return False
        return self.cache.flush()
