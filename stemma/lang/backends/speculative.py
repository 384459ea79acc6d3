"""API speculative execution (SGLang's `@function(num_api_spec_tokens=N)`), for a backend whose
server keeps nothing between calls (OpenAIBackend: every request sends, and is billed for, its
whole prompt).

    Name:{gen name stop="\\n"}\\nBirthday:{gen birthday stop="\\n"}

A gen that cannot be served from an earlier speculation is sent once with at least N tokens to
generate and no stop strings; its text is cut at the gen's own stop, and what the model wrote
after it is kept. The next gen's prompt is that prompt plus the text the program appended since:
when that text is what the model had written, the gen is served from the rest of it (cut at its
stop again), with no request. When the program's text departs from the speculation, or the
speculation ends before the gen's stop, the gen is sent as usual. Without the model's tokenizer
(OpenAIBackend's CharCodec) token counts are unknown here: a served gen is cut at its stop only,
never at max_new_tokens.

Only plain gens are speculated: a constrained gen (regex, json_schema, grammar), one that asks for
logprobs, a streamed one, select's scoring and prefills go to the backend unchanged. A gen served
from a speculation reports no tokens in its meta (it cost no request); the backend's token_usage
counts the requests really sent. Stemma's own backends keep the prompt's KV in their prefix cache
(`reuses_prefix`), so Function does not wrap them: the program runs exactly as without N.
"""
from __future__ import annotations

from typing import Any, Sequence

from stemma.lang.backends.base import Backend, OnText, TokenUsage
from stemma.lang.chat_template import ChatTemplate
from stemma.lang.codec import TokenCodec
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams

_KEPT = 16  # speculations kept per run


class SpeculativeBackend(Backend):
    reuses_prefix = False

    def __init__(self, inner: Backend, num_tokens: int):
        self.inner = inner
        self.num_tokens = num_tokens
        self._speculations: list[tuple[list[int], str, str | None]] = []  # (prompt, text, reason)
        self.served = 0  # gens served from a speculation, with no request

    def for_one_run(self) -> "SpeculativeBackend":
        """Speculations are a program's own, as SGLang keeps them per program: programs of one
        run_batch with the same prompt would otherwise share one sample."""
        return SpeculativeBackend(self.inner, self.num_tokens)

    @property
    def codec(self) -> TokenCodec:
        return self.inner.codec

    @property
    def chat_template(self) -> ChatTemplate:  # type: ignore[override]
        return self.inner.chat_template

    @property
    def token_usage(self) -> TokenUsage:  # type: ignore[override]
        return self.inner.token_usage

    @staticmethod
    def _speculable(params: SamplingParams, on_text: OnText | None) -> bool:
        return (on_text is None and params.max_new_tokens > 0 and not params.is_constrained
                and params.logprob_start is None and not params.logprobs
                and not params.top_logprobs and params.n == 1)

    def _rest(self, ids: list[int]) -> tuple[str, str | None] | None:
        """What an earlier speculation wrote after `ids`, and how it ended; None if none matches."""
        for prompt, text, reason in reversed(self._speculations):
            if len(prompt) > len(ids) or ids[:len(prompt)] != prompt:
                continue
            filled = self.codec.decode(ids[len(prompt):])
            if text.startswith(filled) and len(text) > len(filled):
                return text[len(filled):], reason
        return None

    @property
    def _counts_tokens(self) -> bool:
        """Whether the codec's ids are the model's tokens (not CharCodec's characters)."""
        from stemma.lang.backends.openai import CharCodec
        return not isinstance(self.codec, CharCodec)

    def _cut(self, rest: str, reason: str | None, params: SamplingParams) -> RequestOutput | None:
        """The gen's output out of a speculation's `rest`, or None when the speculation cannot
        tell it (it ended by length before the gen's stop, or the token count is unknown)."""
        found = [(rest.find(s), s) for s in params.stop if s in rest]
        if found:
            text, finish = rest[:min(found)[0]], "stop"
        elif reason == "length":
            if not self._counts_tokens or len(self.codec.encode(rest)) < params.max_new_tokens:
                return None  # the model may have gone on to the gen's stop: ask it
            text, finish = rest, "length"
        else:
            text, finish = rest, reason or "stop"  # the model ended where the speculation did
        ids = self.codec.encode(text)
        if self._counts_tokens and len(ids) > params.max_new_tokens:  # it would have ended first
            ids = ids[:params.max_new_tokens]
            text, finish = self.codec.decode(ids), "length"
        return RequestOutput(rid="speculated", text=text, token_ids=ids, finish_reason=finish,
                             meta={"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                                   "speculated": True})

    async def generate(self, ids: list[int], params: SamplingParams,
                       on_text: OnText | None = None) -> RequestOutput:
        if not self._speculable(params, on_text):
            return await self.inner.generate(ids, params, on_text)
        found = self._rest(ids)
        if found is not None:
            out = self._cut(*found, params)
            if out is not None:
                self.served += 1
                return out
        wide = params.replace(max_new_tokens=max(params.max_new_tokens, self.num_tokens), stop=())
        out = await self.inner.generate(ids, wide)
        self._speculations.append((list(ids), out.text, out.finish_reason))
        del self._speculations[:-_KEPT]
        served = self._cut(out.text, out.finish_reason, params)
        if served is None:  # no stop within the speculation: the gen as asked
            return await self.inner.generate(ids, params)
        return RequestOutput(rid=out.rid, text=served.text, token_ids=served.token_ids,
                             finish_reason=served.finish_reason, meta=dict(out.meta))

    async def generate_batch(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        return await self.inner.generate_batch(requests)

    async def prefill(self, ids: list[int]) -> RequestOutput:
        return await self.inner.prefill(ids)

    async def end_program(self, program_id: str) -> None:
        await self.inner.end_program(program_id)

    async def stats(self) -> dict[str, Any]:
        return await self.inner.stats()
