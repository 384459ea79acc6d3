"""The meta dict of a finished request: token counts and timings, as RequestOutput.meta holds them."""
from __future__ import annotations

import time
from typing import Any

from stemma.engine.request import Request


def request_meta(req: Request) -> dict[str, Any]:
    end = req.finish_time or time.perf_counter()
    meta = {
        "prompt_tokens": len(req.input_ids),
        "cached_tokens": req.cached_tokens,
        "completion_tokens": len(req.output_ids),
        "ttft": (req.first_token_time - req.arrival) if req.first_token_time else None,
        "latency": end - req.arrival,
        "retractions": req.retractions,
    }
    if req.error is not None:  # finish_reason "error": why (a constraint that failed to build)
        meta["error"] = req.error
    return meta
