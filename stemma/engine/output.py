"""A request turned into what it returns: its RequestOutput, and the meta dict of token counts
and timings. The one place this is done; the engine process sends it on (protocol.Finished.of)."""
from __future__ import annotations

import time
from typing import Any

from stemma.engine.request import Request
from stemma.outputs import RequestOutput


def request_meta(req: Request) -> dict[str, Any]:
    end = req.finish_time or time.perf_counter()
    meta = {
        "prompt_tokens": len(req.input_ids),
        "cached_tokens": req.cached_tokens,
        "completion_tokens": len(req.output_ids),
        "ttft": (req.first_token_time - req.arrival) if req.first_token_time else None,
        "latency": end - req.arrival,
        "queue_time": (req.admit_time - req.arrival) if req.admit_time else None,
        "itl": list(req.itl),
        "retractions": req.retractions,
    }
    if req.slo is not None:  # its targets, what it got, which it met (stemma.engine.slo)
        meta["slo"] = req.slo
    if req.stop_reason is not None:  # the stop string or stop token id that ended it
        meta["stop_reason"] = req.stop_reason
    if req.error is not None:  # finish_reason "error": why (a constraint that failed to build)
        meta["error"] = req.error
    return meta


def request_output(req: Request, text: str = "") -> RequestOutput:
    """What `req` returns; `text` is its decoded output (the engine process leaves it to the
    gateway). Fields a request did not ask for (logprobs, ...) are None."""
    p = req.params
    return RequestOutput(
        rid=req.rid, text=text, token_ids=list(req.output_ids), finish_reason=req.finish_reason,
        logprobs=list(req.output_logprobs) if p.logprobs else None,
        top_logprobs=list(req.output_top_logprobs) if p.top_logprobs else None,
        prompt_logprobs=list(req.prompt_logprobs) if p.logprob_start is not None else None,
        meta=request_meta(req))
