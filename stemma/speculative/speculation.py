"""The scheduler's side of speculative decoding: drafts for this step's decoding requests, a
draft length per request, and the booking of what was accepted.

A draft length is chosen per step for the whole batch: draft tokens are added one at a time,
best expected gain per predicted second first (a request's first draft also costs what one more
speculating request adds), while they raise the expected tokens per second of the step. A draft
token j of request r is accepted with probability alpha_r^(j+1), alpha_r the request's measured
acceptance rate (blended with its drafter's, while the request has little history); a step's
time comes from `StepCost`, fitted on this machine's own decode steps (those a compiled graph
ran marked as such, so that the fit stays current while no verify step runs). When the batch is
compute-bound, an extra row costs more than it is expected to return, and no request speculates;
nor does it when a compiled decode graph makes the plain step cheaper than the verify step's
expected gain (verify steps run eager). A verify step's time is the gap before each of its
tokens, so it is bounded, whatever the drafts gain on average: at most `max_verify_steps`
one-row decode steps (eager, as the fit predicts them). A lone stream keeps its drafts; a batch
whose plain step is already near the bound gets few or none, so speculation does not stretch
the inter-token latency tail of a busy engine. Under an ITL target the scheduler caps the step's
draft tokens at what keeps it within the target.
"""
from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from stemma.speculative.cost import StepCost
from stemma.speculative.ngram import NgramDrafter, NgramIndex

if TYPE_CHECKING:
    from stemma.cache.kv_pool import ReqToSlot
    from stemma.cache.radix_cache import RadixCache
    from stemma.engine.plan import StepPlan
    from stemma.engine.request import Request

logger = logging.getLogger(__name__)

PRIOR_WEIGHT = 2.0      # a request's own history counts this many drafts' worth of its drafter's
SOURCE_DECAY = 0.99     # per verified draft: a drafter's rate follows its recent record
MIN_DRAFT_COST = 1e-9   # seconds: a draft the fit takes as free (or cheaper) is ranked by gain alone


@dataclass
class Rate:
    """Draft tokens accepted and first rejections: alpha = hits / (hits + misses)."""
    hits: float = 0.0
    misses: float = 0.0

    def alpha(self, prior: float, weight: float) -> float:
        return (self.hits + weight * prior) / (self.hits + self.misses + weight)

    def book(self, accepted: int, proposed: int, decay: float = 1.0) -> None:
        self.hits = decay * self.hits + accepted
        self.misses = decay * self.misses + (1 if accepted < proposed else 0)


@dataclass
class SpecState:
    """What speculation keeps on a request (Request.spec_state)."""
    index: NgramIndex = field(default_factory=NgramIndex)
    rate: Rate = field(default_factory=Rate)


@dataclass
class SpecCounters:
    proposed: int = 0       # draft tokens verified
    accepted: int = 0       # of which accepted
    verified: int = 0       # request-steps that verified drafts


class Drafter(Protocol):
    """Proposes draft tokens for a step's decoding requests.

    `free`: proposing costs nothing worth counting (a lookup), so proposals are made first and
    their lengths bound the choice; otherwise (a draft model) lengths are chosen first, from the
    acceptance record, and only those tokens are drafted. `sources`: the names its drafts come
    under, with the acceptance rate assumed before any is measured. Drafts must be deterministic
    functions of the request's tokens (verification is exact only for point-mass proposals).
    """
    free: bool
    sources: dict[str, float]

    def propose(self, reqs: list[Request], lengths: list[int]) -> list[tuple[list[int], str]]:
        """Up to lengths[i] draft tokens for reqs[i], and their source."""

    def release(self, req: Request) -> None:
        """req gave back its KV (finished or retracted): forget what is kept for it."""


FORCED = "forced"         # the source of drafts that spell the text a constraint forces
FORCED_PRIOR = 0.9        # its acceptance rate before any is measured


class Guard(Protocol):
    """What speculation asks of constrained decoding (stemma.constrained.Constrainer)."""

    def allowed_drafts(self, req: Request, drafts: list[int]) -> int:
        """How many of `drafts` req's constraint accepts in a row."""

    def forced_drafts(self, req: Request, k: int) -> list[int]:
        """Up to k tokens of the text req's constraint forces from here (none: nothing forced)."""


def _cut(plan: StepPlan, drafts: list[tuple[list[int], str]], reqs: list[tuple[int, Request]],
         guard: Guard | None) -> list[tuple[list[int], str]]:
    """Each constrained request's drafts up to the first one its constraint forbids (none, and
    the request's fault in the plan, when its constraint raises)."""
    out = []
    for (tokens, source), (i, req) in zip(drafts, reqs):
        if req.constraint is not None and tokens:
            try:
                tokens = tokens[:guard.allowed_drafts(req, tokens)]
            except Exception as exc:
                plan.faults[i], tokens = exc, []
        out.append((tokens, source))
    return out


def _propose(drafter: Drafter, reqs: list[Request], lengths: list[int]) -> list[tuple[list[int], str]]:
    """The drafter's proposals; none when it fails (drafts are optional: the step goes on
    without them, as with no drafter)."""
    try:
        return drafter.propose(reqs, lengths)
    except Exception:
        logger.exception("drafting for %d requests failed; the step runs without drafts", len(reqs))
        return [([], next(iter(drafter.sources))) for _ in reqs]


class Speculation:
    def __init__(self, drafter: Drafter, max_tokens: int, max_context: int, cache: RadixCache,
                 req_to_slot: ReqToSlot, max_verify_steps: float = math.inf):
        self.max_tokens = max_tokens
        self.max_verify_steps = max_verify_steps
        self.max_context = max_context
        self.cache = cache
        self.req_to_slot = req_to_slot
        self.drafter = drafter
        self.cost = StepCost()
        self.priors = {**drafter.sources, FORCED: FORCED_PRIOR}
        self.sources = {name: Rate() for name in self.priors}
        self.counters = SpecCounters()
        # seconds a compiled decode graph saves a plain step of n decodes (the engine sets it)
        self.compiled_saving: Callable[[int], float] | None = None

    # ---- planning ----
    def extend(self, plan: StepPlan, indices: list[int], guard: Guard | None = None,
               max_rows: int | None = None, decode_only: bool = True) -> None:
        """Gives the decoding requests at plan `indices` drafts, when they pay, with their slots;
        at most `max_rows` draft tokens in all (the step's latency target; None: no cap).
        `decode_only`: no prefill joins the step, so without drafts it would be a decode forward,
        which a compiled graph may serve (a mixed step runs eager either way).
        A constrained request speculates only under a `guard`: its drafts stop at the first token
        its constraint forbids, and where the constraint forces text, that text is its draft."""
        reqs, limits, forced = [], [], {}  # forced: position in reqs -> the text its constraint forces
        for i in indices:
            req = plan.reqs[i]
            k = min(self.max_tokens, req.remaining_new_tokens - 1, self.max_context - req.kv_len - 2)
            constrained = req.params.is_constrained
            if k > 0 and (not constrained or (guard is not None and req.constraint is not None)):
                if req.constraint is not None:
                    try:
                        tokens = guard.forced_drafts(req, k)
                    except Exception as exc:
                        plan.faults[i] = exc  # a failing request drafts nothing
                        continue
                    if tokens:
                        forced[len(reqs)] = tokens
                if req.spec_state is None:
                    req.spec_state = SpecState()
                reqs.append((i, req))
                limits.append(k)
        if not reqs:
            return
        if self.drafter.free:
            drafts = _cut(plan, _propose(self.drafter, [r for _, r in reqs], limits), reqs, guard)
            drafts = [(forced[j], FORCED) if j in forced and reqs[j][0] not in plan.faults else d
                      for j, d in enumerate(drafts)]
            lengths = self.choose(len(indices), [(self._alpha(r, src), len(t))
                                                 for (_, r), (t, src) in zip(reqs, drafts)], max_rows,
                                  decode_only)
        else:
            (source,) = self.drafter.sources
            lengths = self.choose(len(indices), [
                (self._alpha(r, FORCED), len(forced[j])) if j in forced else (self._alpha(r, source), k)
                for j, ((_, r), k) in enumerate(zip(reqs, limits))], max_rows, decode_only)
            chosen = [(j, r) for j, (_, r) in enumerate(reqs) if lengths[j] and j not in forced]
            drafts = [(forced[j], FORCED) if j in forced else ([], source) for j in range(len(reqs))]
            proposed = _propose(self.drafter, [r for _, r in chosen], [lengths[j] for j, _ in chosen])
            for (j, _), d in zip(chosen, _cut(plan, proposed, [reqs[j] for j, _ in chosen], guard)):
                drafts[j] = d
        lengths = [min(k, len(t)) for k, (t, _) in zip(lengths, drafts)]
        total = sum(lengths)
        if total == 0 or self.cache.allocator.available < total:
            return  # drafts never evict cached prefixes or retract requests
        slots = self.cache.alloc(total)
        at = 0
        for (i, req), (tokens, source), k in zip(reqs, drafts, lengths):
            if k == 0:
                continue
            self.req_to_slot.write(req.row, req.kv_len + 1, slots[at:at + k])
            at += k
            plan.counts[i] = 1 + k
            plan.drafts[i] = (tokens[:k], source)

    def _alpha(self, req: Request, source: str) -> float:
        prior = self.sources[source].alpha(self.priors[source], PRIOR_WEIGHT)
        return req.spec_state.rate.alpha(prior, PRIOR_WEIGHT)

    def choose(self, decodes: int, cands: list[tuple[float, int]], max_rows: int | None = None,
               decode_only: bool = True) -> list[int]:
        """Draft lengths for candidates (alpha, most drafts) in a step of `decodes` decodes, at
        most `max_rows` in all. Drafts are taken best expected gain per predicted second first (a
        request's first draft also costs what one more speculating request adds, so deep drafts
        for a few requests can come before the first of each); of every number of them so taken,
        the one with the most expected tokens per second wins (none: the plain
        step, which a compiled decode graph may make cheaper than any step that verifies, when
        the step is `decode_only`; a mixed step's graph is never asked, so that no prefill queues
        a compile for a batch size no decode forward has). No step is predicted past
        max_verify_steps one-row steps: a first draft that would cross it is passed over, and
        the choice ends at the first deeper draft that would."""
        lengths = [0] * len(cands)
        if not cands or self.cost.steps == 0:
            return lengths  # no measured step yet: nothing to weigh drafts against
        plain = self.cost.predict(decodes, 0, 0)
        if self.compiled_saving is not None and decode_only:
            plain = max(plain - self.compiled_saving(decodes), 1e-6)
        longest = self.max_verify_steps * self.cost.predict(1, 0, 0)
        row = self.cost.predict(decodes, 1, 0) - self.cost.predict(decodes, 0, 0)
        request = self.cost.predict(decodes, 1, 1) - self.cost.predict(decodes, 1, 0)

        def entry(gain: float, j: int, first: bool) -> tuple[float, float, int]:
            return -gain / max(row + request * first, MIN_DRAFT_COST), -gain, j

        tokens, rows, speculating = float(decodes), 0, 0
        best_rate, best_rows, taken = tokens / plain, 0, []
        heap = [entry(alpha, j, True) for j, (alpha, _) in enumerate(cands)]
        heapq.heapify(heap)
        while heap and (max_rows is None or rows < max_rows):
            _, neg_gain, j = heapq.heappop(heap)
            more = speculating + (lengths[j] == 0)
            time = self.cost.predict(decodes, rows + 1, more)
            if time <= 0:
                break
            if time > longest:
                if lengths[j] == 0:  # its speculating request's cost crossed the bound: a deeper
                    continue         # draft of a request that already speculates may still fit
                break  # a draft row alone crossed it: every draft after adds one too
            tokens, rows, speculating = tokens - neg_gain, rows + 1, more
            lengths[j] += 1
            taken.append(j)
            if tokens / time > best_rate:
                best_rate, best_rows = tokens / time, rows
            alpha, most = cands[j]
            if lengths[j] < most:
                heapq.heappush(heap, entry(alpha ** (lengths[j] + 1), j, False))
        lengths = [0] * len(cands)
        for j in taken[:best_rows]:
            lengths[j] += 1
        return lengths

    # ---- booking ----
    def observe(self, plan: StepPlan, seconds: float, compiled: bool = False) -> None:
        """A step's time, for the cost fit (decode-only steps: every row a decode or a draft);
        `compiled`: a compiled decode graph ran it."""
        if plan.decodes and plan.decodes == len(plan.reqs):
            draft_rows = sum(plan.counts) - plan.decodes
            self.cost.observe(plan.decodes, draft_rows, len(plan.drafts), seconds, compiled)

    def book(self, req: Request, source: str, proposed: int, accepted: int) -> None:
        self.counters.proposed += proposed
        self.counters.accepted += accepted
        self.counters.verified += 1
        req.spec_state.rate.book(accepted, proposed)
        self.sources[source].book(accepted, proposed, SOURCE_DECAY)

    def release(self, req: Request) -> None:
        self.drafter.release(req)

    def free_unused(self, req: Request, end: int) -> None:
        """Gives back the slots at positions [req.kv_len, end) of req's row: drafts that were
        rejected (or accepted past a stop), whose KV no token holds."""
        if end > req.kv_len:
            self.cache.free(self.req_to_slot.read(req.row, end, req.kv_len).to(torch.int64))

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {"spec_proposed": c.proposed, "spec_accepted": c.accepted, "spec_steps": c.verified,
                "spec_acceptance_rate": c.accepted / c.proposed if c.proposed else 0.0,
                "spec_mean_accepted": c.accepted / c.verified if c.verified else 0.0}


def make_speculation(config, cache: RadixCache, req_to_slot: ReqToSlot, max_context: int,
                     target=None) -> Speculation | None:
    """The engine's Speculation for `config.speculative`, or None when it is off. `target`: the
    target's ModelRunner, whose device, dtype, pool sizes and vocabulary a draft model follows
    (see DraftModelDrafter.for_engine; without it they come from `config`, vocabulary unchecked)."""
    if config.speculative == "none":
        return None
    if config.speculative == "ngram":
        drafter = NgramDrafter(cache.tree if cache.enabled else None)
    elif config.speculative.startswith("draft:") and len(config.speculative) > len("draft:"):
        from stemma.speculative.draft_model import DraftModelDrafter  # loads a model: on demand
        drafter = DraftModelDrafter.for_engine(config.speculative[len("draft:"):], config,
                                               max_context, target)
    else:
        raise ValueError(f"speculative must be none, ngram or draft:<model path>, got "
                         f"{config.speculative!r}")
    return Speculation(drafter, config.speculative_max_tokens, max_context, cache, req_to_slot,
                       config.speculative_max_verify_steps)
