"""Token ids of a program's text, with the backend's tokenizer.

A program keeps the ids of everything already sent to the model and never re-tokenizes them: text
appended between two model calls is tokenized once, as one piece, right before the next call, and
generated tokens are kept as the model produced them. So every call's prompt extends the previous
call's prompt and output token for token, which is what lets the radix cache serve it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenCodec(ABC):
    """Text <-> ids for one model. `start_ids` open every program (the BOS, when the model has one)."""

    start_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] = frozenset()

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with no special tokens added."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""

    def settle(self, output_ids: Sequence[int], text: str, trimmed: bool,
               stop_ids: Sequence[int] = (), context: Sequence[int] = ()) -> list[int]:
        """The ids a program keeps for a generated `text`: the output ids that spell it.

        A final EOS or stop token (`stop_ids`) is dropped: the text does not hold it. When a stop
        string ended the call (`trimmed`), the engine cut the text there but returned every
        sampled id: ids past the cut are dropped, and a token that straddles it is replaced by the
        tokens of the part the text keeps. `context` (the prompt's last ids) lets the text of the
        output ids be read as the engine read it, after them."""
        ids = list(output_ids)
        while ids and (ids[-1] in self.special_ids or ids[-1] in stop_ids):
            ids.pop()
        if not trimmed:
            return ids
        tail = list(context[-4:])
        base = self.decode(tail)
        for k in range(len(ids), -1, -1):
            full = self.decode(tail + ids[:k])
            head = full[len(base):] if full.startswith(base) else self.decode(ids[:k])
            if text.startswith(head):
                rest = text[len(head):]
                return ids[:k] + (self.encode(rest) if rest else [])
        return self.encode(text)


class HFCodec(TokenCodec):
    """A Hugging Face tokenizer's ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; programs need one to turn their text "
                             "into token ids")
        self.tokenizer = tokenizer
        with_specials = tokenizer("a").input_ids
        plain = tokenizer("a", add_special_tokens=False).input_ids
        cut = len(with_specials) - len(plain)
        self.start_ids = tuple(with_specials[:cut]) if with_specials[cut:] == plain else ()
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
