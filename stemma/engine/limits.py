"""Bounds on what one request may ask, so that hostile input costs a clear error, not the engine.

Each limit is an EngineConfig field (so a `stemma serve` / `stemma generate` flag); `Limits.of`
resolves them once, and `check` refuses a request whose prompt or SamplingParams exceed one with
a ParamError (a ValueError) naming the field, the limit and its option. Pure-value checks that need no
configuration stay in SamplingParams. max_new_tokens has no limit unless one is given: the
context ends every output anyway ("length"), and clients rely on asking more than it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from stemma.sampling_params import ParamError

if TYPE_CHECKING:
    from stemma.engine_config import EngineConfig
    from stemma.sampling_params import SamplingParams


def _over(param: str, what: str, value: int, option: str, limit: int) -> ParamError:
    flag = "--" + option.replace("_", "-")
    return ParamError(param, f"{what} is {value}, more than {option} ({limit}; the engine option {flag})")


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_new_tokens: int | None
    max_n: int
    max_stop_strings: int
    max_stop_chars: int
    max_logit_bias: int
    max_prompt_logprobs: int
    context: int | None = None  # max_prompt_tokens is the context's (no option set it)

    @classmethod
    def of(cls, config: EngineConfig, max_context: int) -> "Limits":
        """The config's limits; the prompt's defaults to the context length less one."""
        return cls(
            max_prompt_tokens=config.max_prompt_tokens or max_context - 1,
            max_new_tokens=config.max_new_tokens_limit,
            max_n=config.max_n, max_stop_strings=config.max_stop_strings,
            max_stop_chars=config.max_stop_chars, max_logit_bias=config.max_logit_bias,
            max_prompt_logprobs=config.max_prompt_logprobs,
            context=max_context if config.max_prompt_tokens is None else None)

    def check(self, ids: Sequence[int], params: SamplingParams) -> None:
        """Raises a ParamError naming the first limit the request exceeds."""
        if len(ids) > self.max_prompt_tokens:
            if self.context is not None:
                raise ParamError("prompt", f"prompt of {len(ids)} tokens does not fit the context of "
                                           f"{self.context} tokens (max_prompt_tokens {self.max_prompt_tokens}: "
                                           f"the context less one; the engine option --max-prompt-tokens)")
            raise _over("prompt", "the prompt's length in tokens", len(ids), "max_prompt_tokens",
                        self.max_prompt_tokens)
        if self.max_new_tokens is not None and params.max_new_tokens > self.max_new_tokens:
            raise _over("max_new_tokens", "max_new_tokens", params.max_new_tokens, "max_new_tokens_limit",
                        self.max_new_tokens)
        if params.n > self.max_n:
            raise _over("n", "n", params.n, "max_n", self.max_n)
        if len(params.stop) > self.max_stop_strings:
            raise _over("stop", "the number of stop strings", len(params.stop), "max_stop_strings",
                        self.max_stop_strings)
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_chars:
            raise _over("stop", "the longest stop string's length", longest, "max_stop_chars",
                        self.max_stop_chars)
        if len(params.logit_bias) > self.max_logit_bias:
            raise _over("logit_bias", "the number of logit_bias entries", len(params.logit_bias),
                        "max_logit_bias", self.max_logit_bias)
        if params.logprob_start is not None:
            scored = max(len(ids) - params.logprob_start, 0)
            if scored > self.max_prompt_logprobs:
                raise _over("logprob_start", "the prompt positions logprob_start asks to score", scored,
                            "max_prompt_logprobs", self.max_prompt_logprobs)
