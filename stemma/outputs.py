"""What a finished request returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestOutput:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None                       # chosen tokens, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob), when asked
    prompt_logprobs: list[float | None] | None = None         # from params.logprob_start on
    meta: dict[str, Any] = field(default_factory=dict)        # prompt_tokens, cached_tokens,
                                                              # completion_tokens, ttft, latency,
                                                              # queue_time, itl (one per output
                                                              # token after the first), retractions,
                                                              # stop_reason (when a stop ended it)

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string or stop token id that ended the sequence; None for EOS, length or a
        constraint's end (vLLM's CompletionOutput.stop_reason)."""
        return self.meta.get("stop_reason")
