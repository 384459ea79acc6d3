"""What the interpreter needs from a model: ids in, outputs out, all as coroutines.

Backends are thin: the in-process Engine (backends/engine.py), a stemma server through its client
(backends/remote.py, which the embedded default also uses), and a deterministic mock for tests of
the language (backends/mock.py). Every prompt is a list of token ids made with `codec`.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any, Callable, Sequence

from stemma.lang.chat_template import ChatTemplate, for_codec
from stemma.lang.codec import TokenCodec
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams

OnText = Callable[[str], None]


class Backend(ABC):
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
