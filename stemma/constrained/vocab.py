"""The bytes each token id stands for, read from a Hugging Face (tokenizers-backed) tokenizer.

Constraints match text, so every token must be known as the exact bytes it adds to the output:

- byte-fallback tokens `<0xHH>` are the raw byte 0xHH;
- SentencePiece's `▁` (in a Metaspace or Replace decoder) is a space;
- GPT-2 ByteLevel tokens map back through its byte-to-unicode table;
- non-special added tokens (Gemma's `\\n\\n`, `<table>`) are their own text;
- special and control tokens (`<bos>`, `<eos>`, `<end_of_turn>`, `<unusedN>`) are no text at all:
  they are excluded, and the end tokens among them are allowed by the constraint only where it is
  complete.

outlines-core's own builder gets Gemma wrong under transformers 5 (it doubles spaces and keeps
`<bos>` as text); this one reads the tokenizer's decoder to know which scheme applies
(stemma.text.token_bytes). Decoders that insert text between tokens (WordPiece, CTC) cannot be
mapped and are refused.

A decoder that strips the first leading space (Metaspace with prepend_scheme, Strip) decodes a
leading space of the output away; the constraint still holds on the token bytes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

from stemma.text.token_bytes import gpt2_byte_decoder, scheme_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Special tokens that end a turn or a document; the model may emit them where it is done.
_END_TOKEN_NAMES = ("<eos>", "</s>", "<end_of_turn>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>",
                    "<|end|>", "<|end_of_text|>")


@dataclass(frozen=True, eq=False)
class TokenVocab:
    """Token id -> bytes over the model's whole logits vocabulary (ids past the tokenizer's are
    None), with the end tokens and the names of the special tokens."""
    token_bytes: tuple[bytes | None, ...]
    eos_token_id: int
    end_ids: tuple[int, ...]           # eos first; allowed exactly where a constraint is complete
    special: dict[int, str]            # excluded special/control tokens, by id

    def __post_init__(self) -> None:
        if not 0 <= self.eos_token_id < self.size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside the vocabulary of {self.size}")
        if self.token_bytes[self.eos_token_id] is not None:
            raise ValueError(f"eos_token_id {self.eos_token_id} must be a special token, not text")

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @cached_property
    def fingerprint(self) -> str:
        """A digest of every token's bytes and the end ids: equal vocabularies share Indexes."""
        digest = hashlib.sha256(repr(self.end_ids).encode())
        for piece in self.token_bytes:
            digest.update(b"\x00" if piece is None else b"\x01%d:%s" % (len(piece), piece))
        return digest.hexdigest()

    @cached_property
    def byte_token_ids(self) -> tuple[int, ...] | None:
        """One token id for each of the 256 single bytes, or None when some byte has no token."""
        found: dict[int, int] = {}
        for token_id, piece in enumerate(self.token_bytes):
            if piece is not None and len(piece) == 1:
                found.setdefault(piece[0], token_id)
        return tuple(found[b] for b in range(256)) if len(found) == 256 else None

    def decode(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[i] or b"" for i in ids)

    def text_map(self) -> dict[bytes, list[int]]:
        """bytes -> token ids, for every text token (what outlines-core's Vocabulary takes)."""
        out: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(self.token_bytes):
            if piece:
                out.setdefault(piece, []).append(token_id)
        return out


def build_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                eos_token_ids: Sequence[int] = ()) -> TokenVocab:
    """The TokenVocab of a transformers tokenizer, padded to the model's `vocab_size` logits.

    `eos_token_ids` are the engine's end ids; the tokenizer's EOS and its end-of-turn style special
    tokens join them.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("constrained decoding needs a tokenizers-backed (fast) tokenizer, got "
                         f"{type(tokenizer).__name__}")
    scheme = scheme_of(backend)
    byte_decoder = gpt2_byte_decoder()
    pieces: list[bytes | None] = [None] * vocab_size
    for piece, token_id in backend.get_vocab(with_added_tokens=False).items():
        if token_id < vocab_size:
            pieces[token_id] = scheme.token_bytes(piece, byte_decoder)
    special: dict[int, str] = {}
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id >= vocab_size:
            continue
        if added.special:
            special[token_id] = added.content
            pieces[token_id] = None
        else:
            pieces[token_id] = added.content.encode("utf-8")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (list(eos_token_ids) or [None])[0]
    if eos is None:
        raise ValueError("constrained decoding needs an EOS token; the tokenizer has none")
    named = [i for i, name in special.items() if name in _END_TOKEN_NAMES]
    ends = [eos] + sorted({*eos_token_ids, *named} - {eos})
    for token_id in ends:
        if pieces[token_id] is not None:
            special[token_id] = pieces[token_id].decode("utf-8", "replace")
            pieces[token_id] = None  # an end token is never text
    return TokenVocab(token_bytes=tuple(p if p else None for p in pieces), eos_token_id=eos,
                      end_ids=tuple(ends), special=special)
