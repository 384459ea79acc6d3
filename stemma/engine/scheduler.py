"""The iteration-level scheduler: decides what each engine step runs and books its results. It
never calls the model (see stemma.engine.plan for the step contract).

    schedule():     take in built constrained requests
                    -> running requests first: decodes (one slot each), then unfinished prefills
                    -> order the waiting queue by policy
                    -> admit waiting requests within the prefill token budget and the chunk size,
                       keeping a KV reserve for the running decodes (Admission)
    postprocess():  advance each request's KV, cache computed prefixes, append sampled tokens,
                    check stops, and release finished requests at once

When the pool runs dry, the running request with the least progress is retracted (Retraction).
A waiting request is radix-matched once per step (PrefixMatches).

Priorities and latency targets (stemma.engine.slo), when any request or the engine sets one:
before the running requests are scheduled, a waiting request of high priority may preempt
lower ones, and lower priorities give way when the step would run past the tightest inter-token
target; the prefill budget and the admissions are then held to that target (the step-cost model,
stemma.engine.step_cost), and the waiting queue is ordered by priority and TTFT deadline.

Constrained requests (regex / json_schema / grammar) first wait in the grammar queue, outside the
batch, while their Index builds on a background thread; the batch never waits for them. Once in
the batch, only their rows are masked, and jump-forward may append forced tokens after a sample,
which the next step extends like a chunk of prefill (see stemma.constrained). A guide whose
check and build outlast `constraint_timeout_s` fails its request, and the build workers are
abandoned to it (stemma.constrained.worker), so it blocks no later request.

Faults (exceptions while serving) end requests with finish reason "error", req.fault and
req.error, never the loop: a fault in booking one request fails that request (`_fail`), a fault
of the whole step fails the step's requests (`fail_step`). Either way the slots the step
allocated for a failed request are freed, and its KV computed before goes to the radix cache.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from stemma.engine import faults, policy
from stemma.engine.admission import Admission, reserve_for
from stemma.engine.counters import Counters
from stemma.engine.plan import StepPlan
from stemma.engine.prefix_match import PrefixMatches
from stemma.engine.programs import Programs, RetentionGuard
from stemma.engine.request import ReqState, Request
from stemma.engine.retraction import Retraction
from stemma.engine.slo import MIN_CHUNK, Slo, victims
from stemma.engine.step_cost import StepCost, StepShape
from stemma.engine.stop import StopRule
from stemma.sampling_params import ParamError
from stemma.speculative.verify import accepted

if TYPE_CHECKING:
    from stemma.cache.kv_pool import ReqToSlot
    from stemma.cache.radix_cache import RadixCache
    from stemma.constrained.constrainer import Constrainer
    from stemma.constrained.spec import ConstraintSpec
    from stemma.engine_config import EngineConfig
    from stemma.executor.executor import StepOutput
    from stemma.sampling_params import SamplingParams
    from stemma.speculative.speculation import Speculation

logger = logging.getLogger(__name__)

SHARED_PREFIX_TOKENS = 16  # in-batch prefix sharing: defer a request sharing this many new tokens
IDLE_WAIT_S = 0.001        # `wait` when nothing is pending that would wake it
UNCHECKED = object()       # `add` without a `check` its caller made
GUIDE_WAIT_S = 1.0         # `wait` while a guide builds (its completion wakes it sooner)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: RadixCache, req_to_slot: ReqToSlot,
                 constrainer: Constrainer, stops: StopRule, spec: Speculation | None = None,
                 cost: StepCost | None = None, programs: Programs | None = None):
        self.config = config
        self.programs = programs if programs is not None else Programs.of(config)
        self.cost = cost if cost is not None else StepCost()
        self.slo = Slo(config, self.cost)
        self.target: tuple[float, int] | None = None  # this step's (T, priority holding it)
        self.spec = spec
        self.cache = cache
        self.req_to_slot = req_to_slot
        self.constrainer = constrainer
        constrainer.budget_closure = config.constraint_budget_closure
        self.stops = stops
        self.max_context = stops.max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.grammar_queue: list[tuple[Request, Future]] = []  # constrained, guide being built
        self.counters = Counters()
        self.matches = PrefixMatches(cache)
        self.retraction = Retraction(self.running, self.waiting, cache, req_to_slot, self._release,
                                     self.counters)
        self._wake = threading.Event()  # set on new work: a request added, a guide built
        self._held_until: float | None = None  # nothing runs and retention holds calls back until then
        self._outranking: set[int] = set()  # ids of this step's waiting requests with preemption victims

    # ---- queue ----
    def check(self, params: SamplingParams) -> ConstraintSpec | Future | None:
        """What `add` needs of params' constraint (None: unconstrained), compiled once to prove it
        sound: a ValueError naming the field when it is not. A compile that outlasts the check
        window is a Future, and a second check would queue behind it, so siblings share one."""
        if not params.is_constrained:
            return None
        try:
            return self.constrainer.check(params)
        except ParamError:
            raise
        except ValueError as exc:  # one constraint per request: the error is that field's
            raise ParamError(params.constraint_field, str(exc)) from None

    def add(self, req: Request, checked: ConstraintSpec | Future | None | object = UNCHECKED) -> None:
        """Queues req; a ValueError (too long, or a bad regex/json_schema/grammar) queues nothing.
        `checked`: what `check` gave for req.params' constraint, when the caller checked it."""
        if len(req.tokens) >= self.max_context:
            raise ParamError("prompt", f"prompt of {len(req.tokens)} tokens does not fit the context of "
                                       f"{self.max_context} tokens")
        spec = self.check(req.params) if checked is UNCHECKED else checked
        req.state = ReqState.WAITING
        if spec is None:
            self.waiting.append(req)
        else:
            future = self.constrainer.start(spec)
            future.add_done_callback(lambda _: self._wake.set())
            self.grammar_queue.append((req, future))
        if req.call is not None and req.program is None:  # once queued: a retracted one comes back
            self.programs.on_submit(req)
        self._wake.set()
        logger.debug("queued %s: %d prompt tokens%s", req.rid, len(req.input_ids),
                     ", constrained" if spec is not None else "")

    def _take_built(self) -> list[Request]:
        """Moves constrained requests whose guide is built to the waiting queue; finishes (with
        reason "error" and req.error) those whose build failed. Returns the finished ones."""
        failed, pending, timed_out = [], [], False
        now = time.perf_counter()
        for req, future in self.grammar_queue:
            if not future.done():
                if now - req.arrival <= self.config.constraint_timeout_s:
                    pending.append((req, future))
                    continue
                req.error = (f"{req.params.constraint_field}: compiling the constraint took longer than "
                             f"constraint_timeout_s ({self.config.constraint_timeout_s:g} s; the "
                             f"engine option --constraint-timeout-s)")
                future.cancel()  # a build chained after its check does not start
                failed.append(self._finish(req, "error"))
                timed_out = True
                continue
            try:
                req.constraint = self.constrainer.attach(req, future.result(), self.max_context)
            except Exception as exc:  # a build failure ends this request only; it is reported
                req.error = f"{type(exc).__name__}: {exc}"
                failed.append(self._finish(req, "error"))
                continue
            self.waiting.append(req)
        self.grammar_queue = pending
        if timed_out:  # the compile cannot be stopped: leave it to its thread, go on without it
            self.constrainer.abandon()
        return failed

    def abort(self, rid: str) -> Request | None:
        req = self._take_out(rid)
        return None if req is None else self._finish(req, "abort")

    def fail(self, rid: str, reason: str) -> Request | None:
        """Between steps: ends request `rid` with an internal error (a fault outside the step,
        such as its detokenizer's), releasing what it holds."""
        req = self._take_out(rid)
        return None if req is None else self._fail(req, reason)

    def _take_out(self, rid: str) -> Request | None:
        """The unfinished request `rid`, out of the grammar or waiting queue (a running one stays
        in `running` until it is released)."""
        for i, (req, future) in enumerate(self.grammar_queue):
            if req.rid == rid:
                del self.grammar_queue[i]
                future.cancel()  # not built when it is still queued
                return req
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.rid == rid:
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_queue)

    def idle_timeout(self) -> float:
        """How long to wait after a step that ran nothing: until the dynamic batch window closes;
        while a guide builds, until it is built (its callback wakes `wait`; GUIDE_WAIT_S caps it);
        while retention holds every waiting call back and nothing runs, until it may stop holding
        (RetentionGuard.wakes_at); else IDLE_WAIT_S."""
        window = self._window_left()
        if window is not None:
            return window
        if self.grammar_queue:
            return GUIDE_WAIT_S
        if self._held_until is not None:  # an arrival wakes `wait` sooner
            return max(self._held_until - time.perf_counter(), IDLE_WAIT_S)
        return IDLE_WAIT_S

    def wait(self, timeout: float) -> None:
        """Blocks until a request is added, a guide is built, or `timeout` seconds pass. Reads no
        scheduler state, so another thread may call it while this one submits."""
        self._wake.wait(timeout)
        self._wake.clear()

    def _window_left(self) -> float | None:
        """Seconds until a dynamic batch window closes, when one is open."""
        if self.config.batching != "dynamic" or self.running or not self.waiting:
            return None
        return max(self.config.dynamic_wait_ms / 1000.0 - self._first_waited_s(), 0.0)

    def _first_waited_s(self) -> float:
        """How long the oldest waiting request has waited."""
        return time.perf_counter() - self.waiting[0].arrival

    # ---- planning ----
    def schedule(self) -> StepPlan:
        """What this step runs, with its slots allocated; empty when nothing can run."""
        plan = StepPlan()
        if self.grammar_queue:
            plan.finished = self._take_built()
        self.matches.clear()
        self.retraction.begin_step()
        admission = Admission(self.config, self.cache, self.req_to_slot, self.running, self.matches,
                              self.retraction, self.counters)
        self.target = None
        self._held_until = None
        self._outranking = set()
        if self.slo.in_play(self.running) or self.slo.in_play(self.waiting):
            self._preempt_for_priority()
            self.target = self._give_way()
        self._schedule_running(plan, admission)
        if self._may_admit():
            self._admit(plan, admission)
        plan.sample = [req.kv_len + n >= len(req.tokens) and req.params.max_new_tokens > 0
                       for req, n in zip(plan.reqs, plan.counts)]
        return plan

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
            return full or self._first_waited_s() * 1000.0 >= self.config.dynamic_wait_ms
        return True

    def _schedule_running(self, plan: StepPlan, admission: Admission) -> None:
        scheduled = self.retraction.scheduled
        self.retraction.ensure_decode_slots(sum(1 for r in self.running if r.is_decoding))
        decodes = [r for r in self.running if r.is_decoding]
        if decodes:
            slots = self.cache.alloc(len(decodes))
            if slots is None:
                raise RuntimeError("KV pool cannot hold one more token per running request")
            rows = torch.tensor([r.row for r in decodes], dtype=torch.int64)
            cols = torch.tensor([r.kv_len for r in decodes], dtype=torch.int64)
            self.req_to_slot.table[rows, cols] = slots.to(torch.int32)
            for r in decodes:
                plan.add(r, 1)
            scheduled.update(id(r) for r in decodes)
            plan.decodes = len(decodes)
            if self.spec is not None:
                # decode-only as far as is known now: nothing to prefill, nobody waiting
                decode_only = not self.waiting and len(decodes) == len(self.running)
                self.spec.extend(plan, list(range(len(decodes))), self.constrainer, self._draft_room(plan),
                                 decode_only)
        for req in [r for r in self.running if not r.is_decoding]:
            if req.state is not ReqState.RUNNING:
                continue  # retracted by an earlier one's allocation in this loop: it waits now
            n = self._timed_chunk(plan, req, admission.chunk(req.extend_len), req.kv_len)
            if n == 0 or not self.retraction.alloc_into(req, n):
                continue  # no budget left, or retracted back to the waiting queue
            admission.take(n)
            plan.add(req, n)
            scheduled.add(id(req))

    # ---- priorities and latency targets (stemma.engine.slo) ----

    def _draft_room(self, plan: StepPlan) -> int | None:
        """The most draft tokens this step's decodes may verify with the step still within its
        ITL target (a verify step is the gap before its tokens); None when no target holds it."""
        if self.target is None:
            return None
        keys = max(req.kv_len for req in plan.reqs[:plan.decodes]) + 1 + self.spec.max_tokens
        return self.slo.decode_room(StepShape.of(plan), self.target[0], keys,
                                    self.spec.max_tokens * plan.decodes)

    def _preempt_for_priority(self) -> None:
        """Retracts running requests at least priority_preemption_gap below a waiting request
        that has no room (batch full, KV short), lowest first, until admission would take it.
        Such a request outranks retained KV too (`_outranking`): it ranks below running requests."""
        gap = self.config.priority_preemption_gap
        rows = tokens = 0  # what the waiting requests seen so far will claim
        for req in self.slo.order(list(self.waiting)):
            pool = victims(self.running, req.params.priority - gap + 1)
            if not pool:
                break  # in priority order: the ones after it have no victims either
            self._outranking.add(id(req))
            need = min(len(req.tokens) - self.matches.length_and_node(req)[0],
                       self.config.chunk_size or len(req.tokens))
            while pool and not self._has_room(req, rows, tokens + need):
                self.retraction.retract(pool.pop(0))
                self.counters.preemptions += 1
            rows, tokens = rows + 1, tokens + need

    def _has_room(self, req: Request, rows: int, tokens: int) -> bool:
        """Whether req, after `rows` rows and `tokens` KV slots for the waiting requests before
        it, would be admitted, counted as the step counts it: a decode slot for each running
        decode first (_schedule_running), then admission's reserve, with req's cached prefix
        locked (Admission.admit), so that no request is preempted in vain."""
        if len(self.running) + rows >= self.config.max_running_requests or self.req_to_slot.available <= rows:
            return False
        decodes = sum(1 for r in self.running if r.is_decoding)
        enforced = self.config.batching == "continuous"  # as _admit enforces it
        reserve = reserve_for(self.running, req, self.config.kv_reserve_ratio) if enforced else 0
        node = self.matches.length_and_node(req)[1]  # matched again: a retraction may split its path
        self.cache.lock(node)
        try:
            return self.retraction.room() >= tokens + decodes + reserve
        finally:
            self.cache.unlock(node)

    def _decode_shape(self) -> StepShape:
        shape = StepShape()
        for r in self.running:
            if r.is_decoding:
                shape.decode(len(r.tokens))
        return shape

    def _give_way(self) -> tuple[float, int] | None:
        """This step's target (T, the priority of the request holding it), after retracting
        running requests of lower priority while the decodes (and the first chunk of the most
        urgent waiting request) are predicted past T."""
        first = [min(self.waiting, key=self.slo.rank)] if self.waiting else []
        held = self.slo.step_target(self.running + first)
        if held is None or not self.cost.ready:
            return held
        target, holder = held
        pool = victims(self.running, holder)
        while True:
            shape = self._decode_shape()
            for req in first:
                if req.params.priority >= holder:
                    shape.prefill(min(len(req.tokens) - self.matches.length_and_node(req)[0], MIN_CHUNK), 0)
            if not pool or self.slo.fits(shape, target):
                return held
            self.retraction.retract(pool.pop(0))
            self.counters.slo_give_way += 1

    def _urgent(self, plan: StepPlan, req: Request, admitting: bool) -> bool:
        """Whether req progresses whatever the step's time: a priority above the target's
        holder; an equal one once admitted, or the first when nothing else runs."""
        holder = self.target[1]
        if req.params.priority != holder:
            return req.params.priority > holder
        return not admitting or not (plan.reqs or any(r.is_decoding for r in self.running))

    def _timed_chunk(self, plan: StepPlan, req: Request, n: int, prefix: int, admitting: bool = False) -> int:
        """Of n prefill tokens for req this step, those that keep the step within its target; an
        urgent request gets MIN_CHUNK whatever the time."""
        if self.target is None or n == 0:
            return n
        target = self.target[0]
        own = self.slo.itl_target(req)
        room = self.slo.prefill_room(StepShape.of(plan), min(target, own) if own else target, prefix, n)
        if self._urgent(plan, req, admitting):
            room = max(room, min(n, MIN_CHUNK))
        return room

    def _admit_fits(self, plan: StepPlan, req: Request) -> bool:
        """Whether the decode steps after req joins stay within the target (an urgent request
        always joins)."""
        if self.target is None:
            return True
        target = self.target[0]
        own = self.slo.itl_target(req)
        if self._urgent(plan, req, admitting=True):
            return True
        shape = self._decode_shape()
        for r in plan.reqs[plan.decodes:]:  # admitted or prefilling now: decodes soon
            shape.decode(len(r.tokens))
        shape.decode(len(req.tokens))
        return self.slo.fits(shape, min(target, own) if own else target)

    def _admit(self, plan: StepPlan, admission: Admission) -> None:
        ordered = policy.order(self.waiting, self.config.schedule_policy, self.matches.length_and_node,
                               self.config.lpm_fallback_queue)
        if self.target is not None or self.slo.in_play(ordered):
            ordered = self.slo.order(ordered)
        continuous = self.config.batching == "continuous"
        guard = self._retention_guard()
        # requests whose prompt KV is being computed now; a waiting request that shares a long
        # uncached prefix with one of them waits a step and then reads that prefix from the cache
        computing = [r for r in self.running if r.kv_len < len(r.input_ids)]
        for req in ordered:
            if len(self.running) >= self.config.max_running_requests:
                break
            if continuous and self._shares_uncached_prefix(req, computing):
                continue
            if not self._admit_fits(plan, req):
                continue
            if (guard is not None and id(req) not in self._outranking
                    and not guard.fits(req, self.matches.length_and_node(req)[0])):
                continue
            budget = admission.budget
            if self.target is not None:  # this admission's chunk kept within the step's target
                cached = self.matches.length_and_node(req)[0]
                admission.budget = self._timed_chunk(plan, req, min(budget, len(req.tokens) - cached), cached,
                                                     admitting=True)
                if admission.budget == 0:
                    admission.budget = budget
                    continue
            first = not req.admitted_once
            n = admission.admit(req, enforce_reserve=continuous)
            admission.budget = budget
            if n is None:
                if continuous:
                    break
                continue
            if first:
                self.programs.on_admitted(req)
            if guard is not None:
                guard.take(req, req.kv_len)
            self.waiting.remove(req)
            admission.take(n)
            computing.append(req)
            logger.debug("admitted %s: %d cached, %d new this step", req.rid, req.kv_len, n)
            if n:
                plan.add(req, n)
        self._held_until = guard.wakes_at() if guard is not None and not self.running else None

    def _retention_guard(self) -> RetentionGuard | None:
        """The program policy's check against evicting retained KV (engine.programs). While
        nothing runs, the KV of programs whose calls wait is not protected from the others."""
        cfg = self.config
        if cfg.schedule_policy != "program" or cfg.radix_eviction != "program":
            return None
        return RetentionGuard(self.programs, self.cache.tree, self.cache.allocator.available,
                              protect_waiting=bool(self.running))

    def _shares_uncached_prefix(self, req: Request, computing: list[Request]) -> bool:
        if not self.cache.enabled or not computing:
            return False
        start = self.matches.length_and_node(req)[0]
        end = start + SHARED_PREFIX_TOKENS
        if end > len(req.tokens):
            return False
        window = req.tokens[start:end]
        return any(r.salt == req.salt and r.tokens[start:end] == window for r in computing)

    # ---- booking the step's results ----
    def postprocess(self, plan: StepPlan, out: StepOutput) -> list[Request]:
        """Books what the step computed; returns the requests that got output or finished.

        Invariant: each slot the plan allocated ends up booked (counted in its request's kv_len)
        or freed. `ends[i]` is the end of request i's allocated positions; those in
        [kv_len, ends[i]) are the ones not booked yet, which a fault of request i frees (`_fail`),
        so a fault while booking one request fails it alone and the others are booked as they
        would have been without it."""
        ends = [req.kv_len + n for req, n in zip(plan.reqs, plan.counts)]
        for i, reason in out.failed.items():  # failed in the executor: nothing of theirs is booked
            self._fail(plan.reqs[i], reason, ends[i])
        for i, (req, n) in enumerate(zip(plan.reqs, plan.counts)):
            if req.finished:
                continue
            try:
                self._book_computed(plan, out, i, n)
            except Exception as exc:
                self._fault(req, exc, ends[i])
        if any(plan.sample):
            self._book_samples(plan, out, ends)
        return plan.finished + list(plan.reqs)

    def _book_computed(self, plan: StepPlan, out: StepOutput, i: int, n: int) -> None:
        """Request i's prompt logprobs and KV progress; caches its computed prefix."""
        req = plan.reqs[i]
        if i in out.prompt_logprobs:
            self._book_prompt_logprobs(req, n, out.prompt_logprobs[i])
        req.kv_len += 1 if i in plan.drafts else n  # a draft's KV counts once it is accepted
        self.programs.on_computed(req, n)
        if req.kv_len < len(req.tokens):
            req.node, _ = self.cache.cache_unfinished(req.row, req.tokens[:req.kv_len], req.salt, req.node,
                                                      req.program)
        elif not plan.sample[i]:
            self._finish(req, "length")  # max_new_tokens == 0: the prompt was all it asked for

    def _fault(self, req: Request, exc: Exception, end: int) -> None:
        """An exception while booking req: it fails, with the traceback in the log."""
        logger.error("request %s failed while booking its step", req.rid, exc_info=exc)
        self._fail(req, f"internal error in postprocess: {type(exc).__name__}: {exc}", end)

    def _fail(self, req: Request, reason: str, end: int | None = None) -> Request:
        """Ends req with finish reason "error" for a fault while serving it (req.fault, req.error
        = reason), first freeing the slots at positions [kv_len, end) of its row: those this
        step allocated that nothing booked."""
        if req.finished:
            return req
        if req.row is not None and end is not None and end > req.kv_len:
            self.cache.free(self.req_to_slot.read(req.row, end, req.kv_len).to(torch.int64))
        req.error, req.fault = reason, True
        logger.warning("request %s failed: %s", req.rid, reason)
        return self._finish(req, "error")

    def fail_step(self, plan: StepPlan, exc: Exception) -> list[Request]:
        """A fault not tied to one request (the forward raised): every request of the step fails,
        the slots the step allocated for them are freed, and their KV computed before this step
        is cached as on any finish. Returns the requests that finished."""
        logger.error("a step of %d requests failed; failing them", len(plan.reqs), exc_info=exc)
        reason = f"internal error in the step: {type(exc).__name__}: {exc}"
        for req, n in zip(plan.reqs, plan.counts):
            self._fail(req, reason, req.kv_len + n)
        return plan.finished + list(plan.reqs)

    def _book_prompt_logprobs(self, req: Request, n: int, values: list[float] | None) -> None:
        done = req.kv_len + n >= len(req.input_ids)
        if (values is not None or done) and not req.prompt_logprobs and req.params.logprob_start == 0:
            req.prompt_logprobs.append(None)  # the first token has no context (a one-token prompt: all)
        if values is not None:
            req.prompt_logprobs.extend(values)
        if done:
            req.prompt_logprobs_done = True

    @staticmethod
    def _book_times(req: Request, k: int, first: bool, now: float) -> None:
        """Inter-token latencies of the k tokens just appended: the time since the last token,
        shared among them; the very first token has none (it is the time to first token)."""
        if k == 0:
            return
        if first:
            req.itl.extend([0.0] * (k - 1))
        else:
            req.itl.extend([(now - req.last_token_time) / k] * k)
        req.last_token_time = now

    def _book_samples(self, plan: StepPlan, out: StepOutput, ends: list[int]) -> None:
        now = time.perf_counter()
        newly_prompt_done = []
        sampled = [i for i, s in enumerate(plan.sample) if s]
        row = 0
        for i, count in zip(sampled, out.counts or [1] * len(sampled)):
            req, rows = plan.reqs[i], range(row, row + count)
            row += count
            if req.finished:  # failed above: its rows are not booked
                continue
            try:
                if self._book_sampled(plan, out, i, rows, ends, now):
                    newly_prompt_done.append(req)
            except Exception as exc:
                self._fault(req, exc, ends[i])
        for req in newly_prompt_done:  # share the prompt with siblings and later requests now
            try:
                req.node, _ = self.cache.cache_unfinished(req.row, req.tokens[:req.kv_len], req.salt, req.node,
                                                          req.program)
            except Exception as exc:
                self._fault(req, exc, req.kv_len)

    def _book_sampled(self, plan: StepPlan, out: StepOutput, i: int, rows: range, ends: list[int],
                      now: float) -> bool:
        """Appends request i's sampled (and accepted draft) tokens from `rows` of `out`, checks
        its stops, and finishes it when one is met. True: these were its first tokens, and it
        goes on (its prompt is cached once the step is booked)."""
        req = plan.reqs[i]
        if faults.INJECTED is not None:
            faults.INJECTED.fire("postprocess", [req])
        count = len(rows)
        first = not req.output_ids
        draft = plan.drafts.get(i)
        computed = 0  # of `news`, the leading tokens whose KV this step computed
        if draft is not None:  # verified: the accepted drafts (their KV is computed), then one
            drafts, source = draft
            news, reason = accepted(drafts, out.token_ids[rows.start:rows.stop]), None
            self.spec.book(req, source, len(drafts), len(news) - 1)
            computed = len(news) - 1
            if req.constraint is not None:
                news, reason, computed = self._advance_path(req, news)
        else:
            # a constrained request may end here, or append forced tokens (jump-forward) in
            # place of the sampled one; a request asking for logprobs is never jump-forwarded
            tok = out.token_ids[rows.start]
            news, reason = ([tok], None) if req.constraint is None else self.constrainer.advance(req, tok)
        if req.first_token_time is None:
            req.first_token_time = now
        appended = len(req.output_ids)
        for j, tok in enumerate(news):
            r = rows[min(j, count - 1)]
            req.append(tok)
            if j < computed:
                req.kv_len += 1
            self.counters.generated_tokens += 1
            if out.logprobs is not None and req.params.logprobs:
                req.output_logprobs.append(out.logprobs[r])
            if out.top_logprobs is not None and req.params.top_logprobs:
                k = req.params.top_logprobs
                ids, values = out.top_logprobs[r]
                # a token the constraint forbids (logprob -inf) is no alternative: left out, so
                # a masked row may list fewer than k (the sampled token is always allowed)
                req.output_top_logprobs.append([(i, v) for i, v in zip(ids[:k], values[:k])
                                                if v != float("-inf")])
            stop = self.stops.check(req, tok)
            if stop is not None:  # the constraint's own end wins on its last token
                reason = reason if reason is not None and j == len(news) - 1 else stop
                break
        if draft is not None:  # rejected drafts (or accepted past a stop): nothing holds their KV
            self.spec.free_unused(req, ends[i])
            ends[i] = req.kv_len
        self._book_times(req, len(req.output_ids) - appended, first, now)
        if reason is not None:
            self._finish(req, reason)
        return first and reason is None

    def _advance_path(self, req: Request, news: list[int]) -> tuple[list[int], str | None, int]:
        """A constrained request's verified tokens through its guide, one by one: (the tokens it
        appends, finish reason, how many lead tokens are accepted drafts). Where the guide ends
        the request, replaces a token or jumps forward, the tokens after that are dropped (their
        rows were verified along a path the request no longer takes)."""
        for j, tok in enumerate(news):
            got, reason = self.constrainer.advance(req, tok, pending=j)
            if got != [tok] or reason is not None:
                kept = j + (1 if got[:1] == [tok] else 0)
                return news[:j] + got, reason, min(kept, len(news) - 1)
        return news, None, len(news) - 1

    # ---- release ----
    def _release(self, req: Request) -> None:
        """Gives back the request's row and KV; computed KV goes to the radix tree."""
        if req.row is None:
            return
        if self.spec is not None:
            self.spec.release(req)
        self.cache.cache_finished(req.row, req.tokens[:req.kv_len], req.salt, req.node, owner=req.program)
        self.req_to_slot.free_row(req.row)
        self.running.remove(req)
        req.row, req.node, req.kv_len = None, None, 0

    def _finish(self, req: Request, reason: str) -> Request:
        kv_len = req.kv_len
        self._release(req)
        self.programs.on_finish(req, kv_len)
        req.constraint = None
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if reason != "abort":
            req.slo = self.slo.attainment.score(req, self.slo)
        logger.debug("finished %s: %s after %d tokens", req.rid, reason, len(req.output_ids))
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

    def stats(self) -> dict:
        return {"queue": len(self.waiting), "running": len(self.running),
                "grammar_queue": len(self.grammar_queue), "preemptions": self.counters.preemptions,
                "slo_give_way": self.counters.slo_give_way, "slo": self.slo.attainment.stats(),
                "step_cost": self.cost.stats(), **self.programs.stats()}
