"""Seeding the step-cost model: synthetic forwards of a few shapes, timed, before any request.

Each forward runs on a table of its own whose every entry is KV slot 0, the padding slot that no
request holds, so the warm-up writes and reads nothing of the pool's real contents. A forward is
timed with an argmax over its logits, the cheapest sampling, which the online updates then
correct with the real steps' times.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from stemma.engine.step_cost import StepCost, StepShape
from stemma.executor.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from stemma.executor.runner import ModelRunner

# (decode rows, their context, prefill tokens): one-row decodes first (the default_itl_slo_steps unit)
SHAPES = [(1, 256, 0)] * 3 + [(8, 256, 0)] * 2 + [(32, 512, 0)] * 2 + [(0, 0, 64)] * 2 \
    + [(0, 0, 256)] * 2 + [(8, 256, 128)] * 2


def dummy_batch(rows: int, context: int, prefill: int, max_context: int) -> tuple[ForwardBatch, StepShape]:
    context, prefill = min(context, max_context - 1), min(prefill, max_context)
    fb = ForwardBatch.on_padding_slot(rows, context, prefill)
    shape = StepShape()
    if rows:
        shape.decode(context + 1, rows=rows)
    if prefill:
        shape.prefill(prefill, 0)
    return fb, shape


def warm_up(runner: ModelRunner, cost: StepCost) -> float:
    """Feeds `cost` the timed SHAPES; returns the median one-row decode forward in seconds."""
    one_row = []
    for rows, context, prefill in SHAPES:
        fb, shape = dummy_batch(rows, context, prefill, runner.max_context)
        one_offs = runner.one_offs()
        t0 = time.perf_counter()
        runner.forward(fb).argmax(dim=-1)
        seconds = time.perf_counter() - t0
        if runner.one_offs() != one_offs:  # it held a row-ops trial or a graph compile: no sample
            continue
        cost.observe(shape, seconds)
        if (rows, prefill) == (1, 0):
            one_row.append(seconds)
    return statistics.median(one_row)
