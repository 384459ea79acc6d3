"""A request as the scheduler sees it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TYPE_CHECKING

from stemma.sampling_params import SamplingParams

if TYPE_CHECKING:
    from stemma.cache.radix_tree import Node
    from stemma.engine.programs import ProgramRecord
    from stemma.program_call import ProgramCall
    from stemma.constrained.guide import Guide
    from stemma.text.detokenizer import TextStream


class RequestFailed(RuntimeError):
    """A request ended with an internal error (req.fault); the engine goes on serving others."""

    def __init__(self, rid: str, error: str | None):
        super().__init__(f"request {rid} failed: {error}")
        self.rid = rid
        self.error = error


class ReqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    KV bookkeeping, for the row `row` of the req->slot table:

        position  0 ........ node.depth | ........ kv_len | kv_len ...... len(tokens)
        slots     the tree's (locked)     the request's    not computed yet (the next extend)

    `tokens` = input_ids + output_ids. While decoding, exactly one token (the last sampled)
    has no KV yet.
    """
    rid: str
    input_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    call: ProgramCall | None = None  # the program context it came with, if any
    program: ProgramRecord | None = None  # its program's record (engine.programs), with call
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    row: int | None = None
    node: Node | None = None         # the locked radix node while running
    kv_len: int = 0
    cached_tokens: int = 0           # prompt tokens served from the cache at first admission
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's)
    error: str | None = None
    fault: bool = False              # it ended "error" from a fault while serving it (an exception
                                     # in the engine), not from its input: an internal error
    retractions: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_logprobs_done: bool = False
    stop_tracker: TextStream | None = None  # made on first use when params.stop is set (engine.stop)
    constraint: Guide | None = None  # the guide of a regex/json_schema/grammar request, once built
    spec_state: Any = None           # speculative decoding's record of it (speculative.SpecState)
    arrival: float = field(default_factory=time.perf_counter)
    admit_time: float | None = None        # first admission: arrival to here is its queue time
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl: list[float] = field(default_factory=list)  # inter-token latency of each output token
                                                    # after the first: len == len(output_ids) - 1
    finish_time: float | None = None
    admitted_once: bool = False
    slo: dict | None = None          # scored against its latency targets at its end (engine.slo)

    def __post_init__(self):
        self.tokens: list[int] = list(self.input_ids) + list(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    @property
    def extend_len(self) -> int:
        return len(self.tokens) - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return self.admitted_once and self.prompt_done and self.extend_len == 1

    @property
    def prompt_done(self) -> bool:
        return self.kv_len >= len(self.tokens) - 1 and bool(self.output_ids)

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.tokens.append(token)

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    def logit_start(self) -> int | None:
        """Absolute position from which this forward must return logits (prompt logprobs)."""
        start = self.params.logprob_start
        if start is None or self.prompt_logprobs_done:
            return None
        return max(start - 1, 0)
