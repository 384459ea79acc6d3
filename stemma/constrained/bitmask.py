"""The allowed tokens of the constrained rows of a step, as one int32 bitmask, applied in one op.

    bitmask[i, t // 32] bit (t % 32) == 1  <=>  row i may sample token t

Each guide writes its row straight into the CPU tensor's memory. End tokens are then set from each
guide's "final" flag, whatever the backend said about them. `apply` unpacks the rows to booleans
through a little-endian uint8 view (token t is byte t // 8, bit t % 8) and sets the disallowed
logits of those rows to -inf with one masked fill. Rows that are not constrained are never read
or written, so their sampling is untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from stemma.constrained.guide import Guide

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill(guides: Sequence[Guide], vocab_size: int) -> torch.Tensor:
    """[len(guides), words] int32 on the CPU: row i is guides[i]'s allowed tokens."""
    words = words_for(vocab_size)
    mask = torch.zeros(len(guides), words, dtype=torch.int32)
    row_bytes = words * 4
    base = mask.data_ptr()
    for i, guide in enumerate(guides):
        guide.fill_mask(base + i * row_bytes, words)
    return mask


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclass(frozen=True)
class EndTokens:
    """Where the end tokens sit in a bitmask row: their words, and the bits in each word."""
    words: torch.Tensor  # [E'] int64, distinct words
    bits: torch.Tensor   # [E'] int32, the end-token bits of each word

    @classmethod
    def of(cls, end_ids: Sequence[int]) -> "EndTokens":
        per_word: dict[int, int] = {}
        for token in end_ids:
            per_word[token // 32] = per_word.get(token // 32, 0) | (1 << (token % 32))
        words = sorted(per_word)
        return cls(torch.tensor(words, dtype=torch.int64),
                   torch.tensor([_as_int32(per_word[w]) for w in words], dtype=torch.int32))

    def set(self, mask: torch.Tensor, final: Sequence[bool]) -> None:
        """Allows the end tokens in the rows that are final, forbids them in the others."""
        if not len(self.words):
            return
        cols = mask[:, self.words]
        on = torch.tensor(final, dtype=torch.bool)[:, None]
        mask[:, self.words] = torch.where(on, cols | self.bits, cols & ~self.bits)


def allowed(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] bool from an int32 bitmask [R, words]."""
    as_bytes = mask.contiguous().view(torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> _SHIFTS.to(mask.device)) & 1  # 0/1 bytes: a valid bool view
    return bits.view(torch.bool).flatten(1)[:, :vocab_size]


@torch.inference_mode()  # the model's logits are inference tensors: updated in place only in here
def apply(logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: logits[rows[i], t] = -inf wherever mask row i forbids t."""
    forbidden = allowed(mask.to(logits.device, non_blocking=True), logits.shape[-1]).logical_not_()
    first, count = rows[0], len(rows)
    if list(rows) == list(range(first, first + count)):  # a block of rows: mask the view
        logits[first:first + count].masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))
