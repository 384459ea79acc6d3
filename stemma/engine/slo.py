"""Latency targets and priorities: what the scheduler weighs each step besides its policy.

A request may carry `priority` (higher first), `ttft_slo_ms` and `itl_slo_ms`
(SamplingParams); the engine's `default_itl_slo_ms` / `default_itl_slo_steps` /
`default_ttft_slo_ms` are the targets of
requests that give none. With no target and no priority anywhere, nothing here changes a step.

Each step (stemma.engine.scheduler):
- the step's time target T is the tightest inter-token target among the running requests and
  the waiting ones about to be admitted; a step is planned to T less the headroom of the cost
  model's recent overruns (their 99.5th percentile), since a target is met by nearly every step;
- priority preemption: a waiting request that does not fit (batch full, KV short) retracts
  running requests at least `priority_preemption_gap` lower, lowest first;
- giving way: when the running decodes alone (plus the first chunk of the highest-priority
  waiting request) are predicted past T, running requests of lower priority than the request
  that holds T are retracted, lowest priority and least progress first. Retraction keeps their
  computed KV in the radix cache, so they lose nothing but the wait;
- the prefill budget is what keeps the predicted step within T (stemma.engine.step_cost), and a
  waiting request is admitted only if the step with it, and the decode steps after, stay within
  T. Urgent requests progress whatever the time, at least MIN_CHUNK prefill tokens a step: those
  of a priority above the holder's, those of its priority once admitted, and the first to join
  a step where nothing else runs (so a target no step can meet still lets the work through);
- waiting requests are ordered by priority, then earliest TTFT deadline (arrival + target), then
  the schedule policy.

At its end, a request with a target is scored (`Attainment`): its time to first token against
its TTFT target and the 99th percentile of its inter-token gaps against its ITL target; the
output's meta["slo"] says which it met, and `stats()["slo"]` counts them per priority.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Iterable

from stemma.engine.step_cost import StepCost, StepShape

if TYPE_CHECKING:
    from stemma.engine.request import Request
    from stemma.engine_config import EngineConfig

MIN_CHUNK = 16  # prefill tokens a top-priority request gets per step even past the target


class Slo:
    def __init__(self, config: EngineConfig, cost: StepCost):
        self.config = config
        self.cost = cost
        self.one_row_s: float | None = None     # the measured one-row decode step (default_itl_slo_steps)
        self.attainment = Attainment()

    # ---- targets ----
    def itl_target(self, req: Request) -> float | None:
        """Seconds between two tokens of req, or None."""
        if req.params.itl_slo_ms is not None:
            return req.params.itl_slo_ms / 1e3
        if self.config.default_itl_slo_ms is not None:
            return self.config.default_itl_slo_ms / 1e3
        if self.config.default_itl_slo_steps is not None and self.one_row_s is not None:
            return self.config.default_itl_slo_steps * self.one_row_s
        return None

    def ttft_target(self, req: Request) -> float | None:
        ms = req.params.ttft_slo_ms if req.params.ttft_slo_ms is not None else self.config.default_ttft_slo_ms
        return None if ms is None else ms / 1e3

    def deadline(self, req: Request) -> float:
        target = self.ttft_target(req)
        return math.inf if target is None else req.arrival + target

    def step_target(self, reqs: Iterable[Request]) -> tuple[float, int] | None:
        """(T, priority of the request that holds it): the tightest ITL target among reqs."""
        best = None
        for r in reqs:
            t = self.itl_target(r)
            if t is not None and (best is None or t < best[0]
                                  or (t == best[0] and r.params.priority > best[1])):
                best = (t, r.params.priority)
        return best

    def in_play(self, reqs: Iterable[Request]) -> bool:
        """Whether any of reqs has a priority or a target, or the engine sets a default target."""
        if self.config.has_default_targets:
            return True
        return any(r.params.priority or r.params.itl_slo_ms is not None or r.params.ttft_slo_ms is not None
                   for r in reqs)

    # ---- ordering ----
    def order(self, ordered: list[Request]) -> list[Request]:
        """The policy's order, regrouped by priority (highest first), then earliest deadline;
        a stable sort, so ties keep the policy's order."""
        return sorted(ordered, key=self.rank)

    def rank(self, req: Request) -> tuple[int, float]:
        """The sort key of `order`: priority (highest first), then deadline."""
        return -req.params.priority, self.deadline(req)

    # ---- time ----
    def fits(self, shape: StepShape, target: float | None) -> bool:
        """Whether a step of `shape` stays within target, with the headroom the model's recent
        overruns call for (StepCost.margin), so that nearly every step does, not the average."""
        if target is None:
            return True
        predicted = self.cost.predict(shape)
        return predicted is None or predicted * (1.0 + self.cost.margin()) <= target

    def prefill_room(self, shape: StepShape, target: float | None, prefix: int, most: int) -> int:
        """The most prefill tokens (<= most) after `prefix` that keep the step within target."""
        return self._room(shape, target, most, lambda trial, n: trial.prefill(n, prefix))

    def decode_room(self, shape: StepShape, target: float | None, seq_len: int, most: int) -> int:
        """The most extra decode rows (<= most) attending `seq_len` keys each (draft tokens to
        verify) that keep the step within target."""
        return self._room(shape, target, most, lambda trial, n: trial.decode(seq_len, rows=n))

    def _room(self, shape: StepShape, target: float | None, most: int,
              add: Callable[[StepShape, int], None]) -> int:
        """The largest n <= most for which `shape` with n units `add`ed stays within target."""
        if target is None or not self.cost.ready:
            return most
        lo, hi = 0, most
        while lo < hi:  # the predicted time grows with n: the largest n that fits
            mid = (lo + hi + 1) // 2
            trial = shape.copy()
            add(trial, mid)
            if self.fits(trial, target):
                lo = mid
            else:
                hi = mid - 1
        return lo


def victims(running: list[Request], below: int) -> list[Request]:
    """Running requests of priority < below, in the order they give way: lowest priority, then
    least progress, then latest arrival."""
    cands = [r for r in running if r.params.priority < below]
    return sorted(cands, key=lambda r: (r.params.priority, len(r.output_ids), -r.arrival))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class Attainment:
    """Per priority: requests with a target, and how many met each target."""

    def __init__(self):
        self.counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def score(self, req: Request, slo: Slo) -> dict | None:
        """req's scores against its targets (None without one); counted per priority."""
        ttft, itl = slo.ttft_target(req), slo.itl_target(req)
        if (ttft is None and itl is None) or req.first_token_time is None:
            return None
        out: dict = {"priority": req.params.priority}
        row = self.counts[req.params.priority]
        row["requests"] += 1
        met = True
        if ttft is not None:
            got = req.first_token_time - req.arrival
            out.update(ttft_ms=round(1e3 * got, 2), ttft_target_ms=round(1e3 * ttft, 2), ttft_met=got <= ttft)
            row["ttft_met"] += out["ttft_met"]
            met &= out["ttft_met"]
        if itl is not None and req.itl:
            got = p99(req.itl)
            out.update(itl_p99_ms=round(1e3 * got, 2), itl_target_ms=round(1e3 * itl, 2), itl_met=got <= itl)
            row["itl_met"] += out["itl_met"]
            met &= out["itl_met"]
        out["met"] = met
        row["met"] += met
        return out

    def stats(self) -> dict[str, dict[str, int]]:
        return {str(p): dict(row) for p, row in sorted(self.counts.items())}
