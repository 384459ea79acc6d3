"""The n-gram drafter (prompt lookup): the tokens that followed the latest earlier occurrence of
the request's last n tokens (n from MAX_N down to MIN_N), in its own prompt and output, repeating
on where the copy reaches the end (a loop is drafted as looping on); or, first,
what the radix tree has cached after all of the request's tokens (another request, or an earlier
branch of the same program, that went this way before)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stemma.cache.radix_tree import RadixTree
    from stemma.engine.request import Request

MIN_N, MAX_N = 2, 4
TREE, NGRAM = "tree", "ngram"


class NgramIndex:
    """One request's n-grams: for each n, the latest end position of each n-gram ending before
    position `upto`. Grows with the request's tokens; tokens are never changed, only appended."""

    def __init__(self):
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MAX_N, MIN_N - 1, -1)}
        self.upto = 0

    def advance(self, tokens: list[int], end: int) -> None:
        for p in range(self.upto, end):
            for n, seen in self.maps.items():
                if p + 1 >= n:
                    seen[tuple(tokens[p + 1 - n:p + 1])] = p
        self.upto = max(self.upto, end)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix, k tokens
        of it. Where that runs past the end of `tokens` and the text has just repeated its last
        p = last - end tokens (a loop), the copy goes on copying itself: the loop is drafted as
        looping on."""
        last = len(tokens) - 1
        self.advance(tokens, last)  # every n-gram but the suffix itself
        for n, seen in self.maps.items():
            if len(tokens) >= n:
                end = seen.get(tuple(tokens[-n:]))
                if end is not None:
                    if end + k <= last or not _loops(tokens, last - end):
                        return tokens[end + 1:end + 1 + k]
                    out: list[int] = []
                    for j in range(end + 1, end + 1 + k):  # position last + 1 + i copies j
                        out.append(tokens[j] if j <= last else out[j - last - 1])
                    return out
        return []


def _loops(tokens: list[int], period: int) -> bool:
    """Whether the last `period` tokens repeat the `period` before them."""
    return len(tokens) >= 2 * period and tokens[-period:] == tokens[-2 * period:-period]


class NgramDrafter:
    """A free drafter (see speculation.Drafter); its state lives on each request's spec_state."""
    free = True
    sources = {TREE: 0.8, NGRAM: 0.5}  # acceptance assumed before any is measured

    def __init__(self, tree: RadixTree | None):
        self.tree = tree

    def propose(self, reqs: list[Request], lengths: list[int]) -> list[tuple[list[int], str]]:
        return [self.propose_one(req, k) for req, k in zip(reqs, lengths)]

    def propose_one(self, req: Request, k: int) -> tuple[list[int], str]:
        """Up to k draft tokens for `req` (its spec_state holds its NgramIndex), and where they
        came from (TREE or NGRAM)."""
        if self.tree is not None:
            cached = self.tree.continuation(req.tokens, req.salt, k)
            if cached:
                return cached, TREE
        return req.spec_state.index.lookup(req.tokens, k), NGRAM

    def release(self, req: Request) -> None:
        """Nothing to give back: the index stays with the request (its tokens stay)."""
