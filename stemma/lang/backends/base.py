"""What the interpreter needs from a model: ids in, outputs out, all as coroutines.

Backends are thin: the in-process Engine (backends/engine.py), a stemma server through its client
(backends/remote.py, which the embedded default also uses), and a deterministic mock for tests of
the language (backends/mock.py). Every prompt is a list of token ids made with `codec`.
"""
from __future__ import annotations

import asyncio
import contextvars
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

from stemma.lang.chat_template import ChatTemplate, for_codec
from stemma.lang.codec import TokenCodec
from stemma.outputs import RequestOutput
from stemma.program_call import ProgramCall
from stemma.sampling_params import SamplingParams

OnText = Callable[[str], None]

# The program context of the requests being made: the interpreter sets it around each model call
# of a program (interpreter.Run.call); a backend that can carry it sends it with each request.
CURRENT_CALL: contextvars.ContextVar[ProgramCall | None] = contextvars.ContextVar("stemma_program_call",
                                                                                default=None)


@dataclass
class TokenUsage:
    """What a backend's requests have cost since it was made (or since `reset()`): every request,
    from every program, generations, selects' scoring and prefills alike. SGLang's
    `backend.token_usage`, with stemma's `cached_tokens` (prompt tokens the prefix cache served)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0

    def add(self, meta: dict[str, Any]) -> None:
        """Counts one request from its output's meta."""
        self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
        self.completion_tokens += int(meta.get("completion_tokens") or 0)
        self.cached_tokens += int(meta.get("cached_tokens") or 0)
        self.requests += 1

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.requests = 0


class Backend(ABC):
    # whether the server keeps a prompt's KV for the next call that extends it (stemma's radix
    # cache does); without it, @function(num_api_spec_tokens=N) speculates (see speculative.py)
    reuses_prefix: bool = True

    @cached_property
    def token_usage(self) -> TokenUsage:
        """The token counts of this backend's requests; each backend adds every output's meta."""
        return TokenUsage()

    @property
    @abstractmethod
    def codec(self) -> TokenCodec:
        """Text <-> ids with the model's own tokenizer."""

    @cached_property
    def chat_template(self) -> ChatTemplate:
        return for_codec(self.codec)

    @abstractmethod
    async def generate(self, ids: list[int], params: SamplingParams,
                       on_text: OnText | None = None) -> RequestOutput:
        """One request (params.n == 1). `on_text`, when given, gets text deltas as they come."""

    async def generate_batch(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        """Several requests submitted together, so that the engine runs them in one batch."""
        return list(await asyncio.gather(*(self.generate(ids, p) for ids, p in requests)))

    def for_one_run(self) -> "Backend":
        """The backend one program run uses: this one, unless it keeps state that must be a
        run's own (a speculative backend's speculations)."""
        return self

    async def end_program(self, program_id: str) -> None:
        """The program calls no more (stemma.program_call); a backend whose server keeps program
        records tells it. This one does nothing."""

    async def prefill(self, ids: list[int]) -> RequestOutput:
        """Puts `ids` in the cache (a request that generates nothing); its meta says how many
        of them were already there."""
        return await self.generate(ids, SamplingParams(max_new_tokens=0))

    @abstractmethod
    async def stats(self) -> dict[str, Any]:
        """The engine's counters: cache_hit_rate, prompt_tokens, cached_tokens, generated_tokens,
        tokens_per_s, running, queue."""

    def close(self) -> None:
        """Releases what the backend holds (sockets, processes)."""
