"""Grammar constraints through llguidance, whose grammar syntax is Lark-like.

The llguidance tokenizer is built from the same TokenVocab as the outlines-core one (special tokens
carry llguidance's 0xFF marker), so both backends agree on what every token spells. Building it
takes about a second for a 262k vocabulary; it is built once, on the constrainer's worker.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from stemma.constrained.closure import budget_error
from stemma.constrained.vocab import TokenVocab

if TYPE_CHECKING:
    import numpy as np
    from llguidance import LLTokenizer

    from stemma.constrained.closure import GrammarClosure, GrammarSearch

# Budget closure for grammars (see stemma.constrained.closure): the completion search runs at
# every step once the budget is within WINDOW tokens of the last completion found, and otherwise
# every few steps (more often as the budget nears it, at most every REFRESH tokens).
WINDOW = 16
REFRESH = 32


class _VocabTokenizer:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, EOS/BOS, and an encoder."""

    def __init__(self, vocab: TokenVocab, encode: Callable[[str], list[int]], bos_token_id: int | None):
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = bos_token_id
        self.special_token_ids = sorted(vocab.special)
        self.tokens = [b"\xff" + vocab.special[i].encode("utf-8") if i in vocab.special else (piece or b"")
                       for i, piece in enumerate(vocab.token_bytes)]
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._encode(text)


def build_lltokenizer(vocab: TokenVocab, encode: Callable[[str], list[int]],
                      bos_token_id: int | None) -> LLTokenizer:
    from llguidance import LLTokenizer, TokenizerWrapper
    wrapper = TokenizerWrapper(_VocabTokenizer(vocab, encode, bos_token_id))
    return LLTokenizer(wrapper, n_vocab=vocab.size, eos_token=list(vocab.end_ids))


class GrammarGuide:
    """A request's walk through an llguidance matcher (see guide.Guide).

    Budget closure: `closure` (None: off) makes a byte-level twin of the grammar on first use and
    searches it for a completion ("plan") from the current state. Once the budget reaches the
    plan's length plus `margin`, the mask keeps only the plan's next token (only EOS where the
    plan is empty). A sampled token after which no completion is found within the budget is
    replaced by the plan's next token (or EOS) in `after_accept`, unless `margin` > 0 (logprob
    requests, whose sampled tokens are kept as sampled): then the plan is followed `margin`
    tokens earlier instead. The plan is a short completion, not always the shortest.
    """

    exact_closure = False  # shortest() is what a bounded search found

    def __init__(self, lltokenizer: LLTokenizer, grammar: str, closure: GrammarClosure | None = None):
        from llguidance import LLMatcher
        self._matcher = LLMatcher(lltokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"grammar is invalid: {self._matcher.get_error()}")
        self.error: str | None = None
        self.budget: int | None = None
        self.closure_error: str | None = None
        self.closure_acted = False
        self.closure_logged = False
        self.margin = 0
        self._grammar = grammar
        self._closure = closure
        self._search: GrammarSearch | None = None
        self._tokens: list[int] = []          # accepted so far (the twin follows them)
        self._serial = 0                      # bumped on every change of state
        self._plan: tuple[int, list[int] | None] | None = None  # (serial, plan) of the last search
        self._before: list[int] | None = None  # the plan of the state before the last token
        self._estimate: tuple[int, int | None] | None = None  # (tokens accepted, plan length)

    def fill_mask(self, address: int, words: int) -> None:
        self._matcher.unsafe_compute_mask_ptr(address, words * 4)

    def accept(self, token: int) -> bool:
        if not self._matcher.consume_token(token):
            self.error = self._matcher.get_error().strip().splitlines()[0]
            return False
        plan = self._current()
        self._before = plan
        self._tokens.append(token)
        self._serial += 1
        if plan and plan[0] == token:  # on the plan: the rest of it completes from here
            self._plan = (self._serial, plan[1:])
        return True

    def accept_many(self, tokens: list[int]) -> int:
        done = self._matcher.try_consume_tokens(tokens)
        if done:
            self._tokens.extend(tokens[:done])
            self._serial += 1
            self._before = None
        return done

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)
            del self._tokens[-count:]
            self._serial += 1
            self._before = None

    def is_final(self) -> bool:
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def forced_bytes(self, limit: int) -> bytes:
        return self._matcher.compute_ff_bytes()[:limit]

    # ---- budget closure: a bounded search on the byte-level twin ----
    def shortest(self) -> int | None:
        if self._closure is None:
            return None
        plan = self._searched()
        return None if plan is None else len(plan)

    def restrict(self, row: np.ndarray) -> bool:
        budget = self.budget
        if self._closure is None or budget is None or not self._due(budget):
            return False
        plan = self._searched()
        if plan is None or len(plan) > budget:
            if plan is not None or budget <= WINDOW:
                found = None if plan is None else len(plan)
                self.closure_error = budget_error(found, budget, "grammar")
            return False
        if budget > len(plan) + self.margin:
            return False
        if plan:
            token = plan[0]
            if not int(row[token >> 5]) >> (token & 31) & 1:  # the matcher disagrees: leave it
                self.closure_error = ("constraint budget: the grammar refused its own completion "
                                      f"token {token}")
                return False
            row[:] = 0
            row[token >> 5] = 1 << (token & 31)
        else:
            row[:] = 0  # complete: only the end tokens (set by the constrainer) remain
        return True

    def completes_within(self, tokens: int) -> bool:
        if self._closure is None or not self._due(tokens):
            return True
        plan = self._searched()
        return plan is not None and len(plan) <= tokens

    def after_accept(self, token: int, left: int) -> int | None:
        before = self._before
        if self._closure is None or self.margin or before is None or not self._due(left):
            return None
        plan = self._searched()
        if plan is not None and len(plan) <= left:
            return None
        if len(before) > left + 1:
            return None  # the budget was already short of the plan: nothing to fall back on
        self.rollback(1)
        if not before:  # it was complete: stop there
            return self._closure.eos_token_id
        if not self.accept(before[0]):
            raise RuntimeError(f"grammar refused its own completion token {before[0]}: {self.error}")
        self._plan = (self._serial, before[1:])
        return before[0]

    def _current(self) -> list[int] | None:
        """The plan of the current state, when one is known."""
        if self._plan is not None and self._plan[0] == self._serial:
            return self._plan[1]
        return None

    def _searched(self) -> list[int] | None:
        """The plan of the current state, searched for when not known."""
        if self._plan is not None and self._plan[0] == self._serial:
            return self._plan[1]
        try:
            if self._search is None:
                self._search = self._closure.search(self._grammar)
            plan = self._search.plan(self._tokens)
        except Exception as exc:  # a grammar the byte-level twin cannot take: no closure for it
            self._closure = None
            self.closure_error = f"constraint budget: no completion search for this grammar ({exc})"
            return None
        self._plan = (self._serial, plan)
        # a failed search (none found within its bounds) is not repeated for REFRESH tokens
        self._estimate = (len(self._tokens), len(plan) if plan is not None else None)
        return plan

    def _due(self, budget: int) -> bool:
        """Whether to look for a completion now: near the budget, or not looked at for a while."""
        if self._plan is not None and self._plan[0] == self._serial:
            return True  # known: free
        if self._estimate is None:
            return True
        at, length = self._estimate
        if length is None:
            return len(self._tokens) - at >= REFRESH
        slack = budget - length - WINDOW
        if slack <= 0:
            return True
        return len(self._tokens) - at >= min(REFRESH, max(1, slack // 4))
