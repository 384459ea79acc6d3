"""A deterministic backend for tests of the language without a model.

- Tokens are Unicode code points (id = ord(char)); id 1 is the BOS that starts every program.
- A reply is `reply(prompt_text)` when given, else words picked by a hash of the prompt ids, so
  the same prompt always gets the same reply. It is cut at stop strings (the ids keep the stop
  string, as the engine's do) and at max_new_tokens characters.
- A request with a regex (gen's `dtype` is one) or a JSON schema gets text that fullmatches it,
  as deterministic as the rest (see mock_constraint.py); `choices` make a select, which picks
  one of them by the logprobs below.
- The logprob of token t after context c is `mock_logprob(c, t)`, a hash of both, in [-10, -0.01].
  A gen that asks for logprobs gets each output token's; with top_logprobs=k, the output token
  and the k-1 code points after it, most likely first.
- A prefix cache is modelled the way the engine's radix cache behaves: a request's cached tokens
  are its longest prefix that an earlier request's prompt or output holds, capped one short of
  the prompt and one short of logprob_start (whose logits the scoring needs).
- `calls` logs every request; `batches` the sizes of generate_batch calls.
"""
from __future__ import annotations

import asyncio
import hashlib
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stemma.lang.backends.base import Backend, OnText
from stemma.lang.backends.mock_constraint import constrained_text, pattern_of
from stemma.lang.codec import TokenCodec
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams

BOS = 1
_WORDS = ("alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "nova", "oscar", "papa")


def mock_logprob(context: Sequence[int], token: int) -> float:
    key = ",".join(map(str, [*context[-32:], -1, token])).encode()
    return -0.01 - (zlib.crc32(key) % 1000) / 100.0


def default_reply(ids: Sequence[int], length: int) -> str:
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).digest()
    words, i = [], 0
    while sum(len(w) + 1 for w in words) < length:
        words.append(_WORDS[digest[i % len(digest)] % len(_WORDS)])
        i += 1
    return " " + " ".join(words)


class MockCodec(TokenCodec):
    start_ids = (BOS,)
    special_ids = frozenset({BOS})

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids if i not in self.special_ids)


@dataclass(frozen=True)
class MockCall:
    ids: tuple[int, ...]
    params: SamplingParams
    cached_tokens: int


class _Trie:
    def __init__(self):
        self.root: dict[int, dict] = {}

    def match(self, ids: Sequence[int]) -> int:
        node, n = self.root, 0
        for t in ids:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def insert(self, ids: Sequence[int]) -> None:
        node = self.root
        for t in ids:
            node = node.setdefault(t, {})


class MockBackend(Backend):
    def __init__(self, reply: Callable[[str], str] | None = None):
        self.reply = reply
        self._codec = MockCodec()
        self._trie = _Trie()
        self.calls: list[MockCall] = []
        self.batches: list[int] = []
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}

    @property
    def codec(self) -> TokenCodec:
        return self._codec

    def _answer(self, ids: list[int], params: SamplingParams) -> tuple[str, list[int], str]:
        """(text, output ids, finish reason): the reply, cut at a stop string or the budget; under
        a constraint, kept if it fullmatches, else its characters where the pattern allows them."""
        text, out_ids, reason = self._reply(ids, params)
        pattern = pattern_of(params)
        if pattern is None:
            return text, out_ids, reason
        constrained, complete = constrained_text(pattern, ids, params.max_new_tokens, text)
        if constrained == text and complete:
            return text, out_ids, "stop"
        return constrained, self._codec.encode(constrained), "stop" if complete else "length"

    def _reply(self, ids: list[int], params: SamplingParams) -> tuple[str, list[int], str]:
        limit = params.max_new_tokens
        raw = self.reply(self._codec.decode(ids)) if self.reply else default_reply(ids, limit)
        cut = [(raw.find(s), s) for s in params.stop if s in raw]
        if cut:
            at, stop = min(cut)
            if at < limit:
                return raw[:at], self._codec.encode(raw[:at + len(stop)])[:limit], "stop"
        text = raw[:limit]
        return text, self._codec.encode(text), "length" if len(raw) >= limit else "stop"

    def _request(self, ids: list[int], params: SamplingParams) -> RequestOutput:
        if not ids:
            raise ValueError("prompt must hold at least one token")
        cap = len(ids) - 1
        if params.logprob_start is not None:  # the token before the first scored one is recomputed
            cap = max(min(cap, params.logprob_start - 1), 0)
        cached = min(self._trie.match(ids), cap)
        text, out_ids, reason = self._answer(ids, params)
        self._trie.insert(ids + out_ids)
        self.calls.append(MockCall(tuple(ids), params, cached))
        for key, value in (("prompt_tokens", len(ids)), ("cached_tokens", cached),
                           ("generated_tokens", len(out_ids))):
            self.counters[key] += value
        prompt_logprobs = None
        if params.logprob_start is not None:
            prompt_logprobs = [None if pos == 0 else mock_logprob(ids[:pos], ids[pos])
                               for pos in range(params.logprob_start, len(ids))]
        meta = {"prompt_tokens": len(ids), "cached_tokens": cached, "completion_tokens": len(out_ids)}
        self.token_usage.add(meta)
        logprobs = top = None
        if params.logprobs:
            logprobs = [mock_logprob(ids + out_ids[:i], t) for i, t in enumerate(out_ids)]
        if params.top_logprobs:  # as the engine: with or without logprobs
            top = [sorted(((c, mock_logprob(ids + out_ids[:i], c)) for c in range(t, t + params.top_logprobs)),
                          key=lambda pair: -pair[1]) for i, t in enumerate(out_ids)]
        return RequestOutput(
            rid=f"mock-{len(self.calls)}", text=text, token_ids=out_ids, finish_reason=reason,
            logprobs=logprobs, top_logprobs=top, prompt_logprobs=prompt_logprobs, meta=meta)

    async def generate(self, ids: list[int], params: SamplingParams,
                       on_text: OnText | None = None) -> RequestOutput:
        await asyncio.sleep(0)
        out = self._request(ids, params)
        if on_text is not None:
            for char in out.text:
                on_text(char)
                await asyncio.sleep(0)
        return out

    async def generate_batch(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        await asyncio.sleep(0)
        self.batches.append(len(requests))
        return [self._request(ids, p) for ids, p in requests]

    async def stats(self) -> dict[str, Any]:
        c = self.counters
        return {**c, "cache_hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                "tokens_per_s": 0.0, "running": 0, "queue": 0}
