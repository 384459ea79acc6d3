"""A Guide walks one request through its constraint, token by token. RegexGuide drives an
outlines-core Index (regexes and JSON schemas); grammar.GrammarGuide drives llguidance.

Both answer the same questions, so the scheduler's mask path and jump-forward never ask which kind
they hold. "Final" means the end tokens are allowed now; "terminated" means nothing else is.

Budget closure (stemma.constrained.closure): the constrainer sets `budget`, the tokens the request
may still append (None: no closure), and keeps it current; `restrict` then narrows each filled
mask row to the tokens after which the constraint can still be completed within the budget.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from stemma.constrained.vocab import TokenVocab

if TYPE_CHECKING:
    import numpy as np

    from stemma.constrained.closure import RegexClosure
    from stemma.constrained.end_mark import EndIndex

MAX_ROLLBACK = 256    # tokens a guide can step back (jump-forward re-tokenizes its boundary)
# Bytes tried first when looking for the single forced byte: printable ASCII ends the search fast.
_PROBE_ORDER = tuple(range(0x20, 0x7F)) + tuple(b for b in range(256) if not 0x20 <= b < 0x7F)


class Guide(Protocol):
    error: str | None  # why the last accept failed
    budget: int | None  # tokens the request may still append; None: no budget closure
    closure_error: str | None  # why the budget cannot be met (goes to the request's meta)

    def fill_mask(self, address: int, words: int) -> None:
        """Writes the allowed-token bitmask (bit t of word t // 32) of `words` int32 at `address`."""

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (and `error` set) when it is not allowed, after which the
        guide is not used again."""

    def accept_many(self, tokens: list[int]) -> int:
        """Advances past the longest allowed prefix of `tokens`; returns its length. The guide
        stays usable (a refused token changes nothing)."""

    def rollback(self, count: int) -> None:
        """Undoes the last `count` accepted tokens."""

    def is_final(self) -> bool: ...

    def is_terminated(self) -> bool: ...

    def forced_bytes(self, limit: int) -> bytes:
        """The bytes that every continuation from here starts with (at most `limit`)."""

    def shortest(self) -> int | None:
        """Tokens of the shortest completion from here (0: complete), None when not known."""

    def restrict(self, row: np.ndarray) -> bool:
        """Narrows this guide's filled mask row (uint32 words) to the tokens after which the
        constraint can be completed within `budget` tokens; True when it changed anything."""

    def completes_within(self, tokens: int) -> bool:
        """Whether a completion of at most `tokens` tokens is known from here."""

    def after_accept(self, token: int, left: int) -> int | None:
        """After `token` was accepted with `left` tokens of budget after it: a token to put in
        its place (already accepted instead of it) when it left no completion within the budget,
        else None."""


class RegexGuide:
    """A request's walk through an outlines-core Index (an end_mark.EndIndex: "final" is where
    the regex may end, not outlines-core's final states).

    Forced bytes are found through the vocabulary's 256 single-byte tokens: a byte is allowed next
    exactly when its token is (a longer token implies its first byte is), so one allowed byte
    where the regex may not end is a forced byte. Vocabularies without all 256 byte tokens force
    nothing. Where it may end, whether it also goes on is asked of the allowed tokens (a plain
    Index, from outlines-core 0.2.14, may keep a multi-byte token there and none of its bytes).
    """

    exact_closure = True  # shortest() is exact

    def __init__(self, index: EndIndex, vocab: TokenVocab, closure: RegexClosure | None = None):
        from outlines_core import Guide as OutlinesGuide
        self._ends = index
        self._index = index.index
        self._guide = OutlinesGuide(index.index, max_rollback=MAX_ROLLBACK)
        self._byte_ids = vocab.byte_token_ids
        self._eos = vocab.eos_token_id
        self._closure = closure
        self.error: str | None = None
        self.budget: int | None = None
        self.closure_error: str | None = None
        self.closure_acted = False  # set by the constrainer once closure changed this request
        self.closure_logged = False
        self._goes_on: dict[int, bool] = {}  # state where it may end -> a token but EOS is allowed

    def fill_mask(self, address: int, words: int) -> None:
        self._guide.write_mask_into(address, words, 4)

    def accept(self, token: int) -> bool:
        try:
            self._guide.advance(token, return_tokens=False)
        except ValueError as exc:
            self.error = str(exc)
            return False
        return True

    def accept_many(self, tokens: list[int]) -> int:
        for done, token in enumerate(tokens):
            if not self.accept(token):
                self.error = None
                return done
        return len(tokens)

    def rollback(self, count: int) -> None:
        if count:
            self._guide.rollback_state(count)

    def is_final(self) -> bool:
        return self._ends.accepting(self._guide.get_state())

    def is_terminated(self) -> bool:
        state = self._guide.get_state()
        return self._ends.accepting(state) and not self._continues(state)

    def forced_bytes(self, limit: int) -> bytes:
        if self._byte_ids is None:
            return b""
        state, out = self._guide.get_state(), bytearray()
        while len(out) < limit and not self._ends.accepting(state):
            step = self._single_byte(state)
            if step is None:
                break
            out.append(step[0])
            state = step[1]
        return bytes(out)

    # ---- budget closure: exact, from the Index's shortest-completion lengths ----
    def shortest(self) -> int | None:
        if self._closure is None:
            return None
        return self._closure.distance(self._guide.get_state())

    def restrict(self, row: np.ndarray) -> bool:
        if self._closure is None or self.budget is None:
            return False
        return self._closure.restrict(row, self._guide.get_state(), self.budget)

    def completes_within(self, tokens: int) -> bool:
        return self._closure is None or self._closure.distance(self._guide.get_state()) <= tokens

    def after_accept(self, token: int, left: int) -> int | None:
        return None  # the mask already kept only tokens that leave a completion

    def _single_byte(self, state: int) -> tuple[int, int] | None:
        """(byte, next state) when exactly one byte may follow `state`, else None."""
        found = None
        for byte in _PROBE_ORDER:
            nxt = self._index.get_next_state(state, self._byte_ids[byte])
            if nxt is not None:
                if found is not None:
                    return None
                found = (byte, nxt)
        return found

    def _continues(self, state: int) -> bool:
        """Whether any token but EOS is allowed in `state`."""
        if state not in self._goes_on:
            self._goes_on[state] = any(t != self._eos for t in self._index.get_allowed_tokens(state))
        return self._goes_on[state]
