"""What one engine step runs, as the scheduler planned it (the step contract):

    plan = scheduler.schedule()       which requests run, how many new tokens each; slots allocated
    out  = executor.run(plan)         one forward over the mixed batch, then sampling
    scheduler.postprocess(plan, out)  books the results: KV progress, tokens, stops, finishes
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stemma.engine.request import Request


@dataclass
class StepPlan:
    """Request i runs `counts[i]` new tokens, whose KV slots are already in its req->slot row at
    positions [kv_len, kv_len + counts[i]). `sample[i]`: its last new token completes the sequence
    so far, so the step samples a token for it. `finished`: requests that ended while planning
    (a constraint that failed to build), reported with the step's results. `drafts[i]`: the
    draft tokens request i verifies this step, and their drafter; its counts[i] is then
    1 + len(drafts), and its draft slots sit right after its decode slot."""
    reqs: list[Request] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    drafts: dict[int, tuple[list[int], str]] = field(default_factory=dict)
    decodes: int = 0                 # requests 0..decodes-1 decode (with or without drafts)
    # request i's constraint raised while its drafts were planned: it runs draftless and fails
    # with the step's results (its guide may be left mid-way), its neighbours unaffected
    faults: dict[int, Exception] = field(default_factory=dict)

    def add(self, req: Request, n: int) -> None:
        self.reqs.append(req)
        self.counts.append(n)

    @property
    def sampled(self) -> list[Request]:
        return [r for r, s in zip(self.reqs, self.sample) if s]

    def __bool__(self) -> bool:
        return bool(self.reqs)
