"""How select decides, from the logprobs of each choice's tokens. Pure functions, no model.

`cond[i][j]` is log p(token j of choice i | prefix, earlier tokens of choice i).

- token_length_normalized (the default): the mean of cond[i]; the highest wins.
- greedy_token: token by token. At position j the choices still in the race keep only those whose
  logprob at j is the highest (within 1e-9); a choice with no token at j competes with its mean.
  The race ends when one choice is left, or at the longest choice's end (the first left wins).
  Reported scores are the means, as for the default.
- unconditional_likelihood_normalized: the mean of cond[i][j] - uncond[i][j], where uncond holds
  the same tokens' logprobs given only a neutral context (see the interpreter: the tokenizer's BOS,
  or, without one, the prefix's last token). It discounts choices that are likely anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

DEFAULT_METHOD = "token_length_normalized"
METHODS = ("token_length_normalized", "greedy_token", "unconditional_likelihood_normalized")
_TIE = 1e-9


@dataclass(frozen=True)
class SelectResult:
    """What a select decided, and why."""
    choice: str
    index: int
    scores: tuple[float, ...]                       # one per choice; higher is better
    token_logprobs: tuple[tuple[float, ...], ...]   # cond, per choice and token
    method: str
    unconditional_logprobs: tuple[tuple[float, ...], ...] | None = None
    token_ids: tuple[tuple[int, ...], ...] | None = None  # each choice's tokens, as scored

    def sglang_meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info of a select: each choice's mean logprob (normalized_prompt_logprobs)
        and its tokens' (logprob, token id, None), with this result's own fields."""
        ids = self.token_ids or tuple((None,) * len(lps) for lps in self.token_logprobs)
        info: dict[str, Any] = {
            "choice": self.choice, "index": self.index, "scores": list(self.scores), "method": self.method,
            "normalized_prompt_logprobs": [mean(lps) if lps else 0.0 for lps in self.token_logprobs],
            "input_token_logprobs": [[(lp, t, None) for lp, t in zip(lps, tids)]
                                     for lps, tids in zip(self.token_logprobs, ids)]}
        if self.unconditional_logprobs is not None:
            info["unconditional_token_logprobs"] = [[(lp, t, None) for lp, t in zip(lps, tids)]
                                                    for lps, tids in zip(self.unconditional_logprobs, ids)]
        return info


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _argmax(scores: Sequence[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def greedy_token_index(cond: Sequence[Sequence[float]]) -> int:
    alive = list(range(len(cond)))
    for j in range(max(len(c) for c in cond)):
        at = {i: cond[i][j] if j < len(cond[i]) else mean(cond[i]) for i in alive}
        best = max(at.values())
        alive = [i for i in alive if at[i] >= best - _TIE]
        if len(alive) == 1:
            break
    return alive[0]


def decide(method: str, choices: Sequence[str], cond: Sequence[Sequence[float]],
           uncond: Sequence[Sequence[float]] | None = None) -> SelectResult:
    if method not in METHODS:
        raise ValueError(f"select method must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "unconditional_likelihood_normalized":
        if uncond is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs")
        scores = [mean([c - u for c, u in zip(ci, ui)]) for ci, ui in zip(cond, uncond)]
    else:
        scores = [mean(ci) for ci in cond]
    index = greedy_token_index(cond) if method == "greedy_token" else _argmax(scores)
    return SelectResult(
        choice=choices[index], index=index, scores=tuple(scores),
        token_logprobs=tuple(tuple(c) for c in cond), method=method,
        unconditional_logprobs=None if uncond is None else tuple(tuple(u) for u in uncond))
