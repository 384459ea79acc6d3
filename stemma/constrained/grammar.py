"""Grammar constraints through llguidance, whose grammar syntax is Lark-like.

The llguidance tokenizer is built from the same TokenVocab as the outlines-core one (special tokens
carry llguidance's 0xFF marker), so both backends agree on what every token spells. Building it
takes about a second for a 262k vocabulary; it is built once, on the constrainer's worker.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from stemma.constrained.vocab import TokenVocab

if TYPE_CHECKING:
    from llguidance import LLTokenizer


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
    """A request's walk through an llguidance matcher (see guide.Guide)."""

    def __init__(self, lltokenizer: LLTokenizer, grammar: str):
        from llguidance import LLMatcher
        self._matcher = LLMatcher(lltokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"grammar is invalid: {self._matcher.get_error()}")
        self.error: str | None = None

    def fill_mask(self, address: int, words: int) -> None:
        self._matcher.unsafe_compute_mask_ptr(address, words * 4)

    def accept(self, token: int) -> bool:
        if self._matcher.consume_token(token):
            return True
        self.error = self._matcher.get_error().strip().splitlines()[0]
        return False

    def accept_many(self, tokens: list[int]) -> int:
        return self._matcher.try_consume_tokens(tokens)

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)

    def is_final(self) -> bool:
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def forced_bytes(self, limit: int) -> bytes:
        return self._matcher.compute_ff_bytes()[:limit]
