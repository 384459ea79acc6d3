"""The bytes a token id stands for, read from a Hugging Face tokenizers backend's decoder: what
constrained decoding matches (stemma.constrained.vocab) and what a logprobs entry's `bytes` holds
(stemma.serve.http), where decoding one token alone gives U+FFFD for a piece of a character.

- byte-fallback tokens `<0xHH>` are the raw byte 0xHH;
- SentencePiece's `▁` (in a Metaspace or Replace decoder) is a space;
- GPT-2 ByteLevel tokens map back through its byte-to-unicode table.

Decoders that insert text between tokens (WordPiece, CTC) cannot be mapped and are refused.
Torch-free, and imports no transformers: it reads the backend it is given.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_UNMAPPABLE_DECODERS = ("WordPiece", "CTC", "BPEDecoder")


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's ByteLevel alphabet, inverted: printable Latin-1 bytes stand for themselves, the other
    bytes for the code points from 256 up, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in table.items()}


@dataclass(frozen=True)
class DecoderScheme:
    """How a tokenizer's token strings become bytes."""
    byte_level: bool         # GPT-2 ByteLevel
    byte_fallback: bool      # <0xHH> tokens are raw bytes
    space_marker: str | None  # the SentencePiece word marker (▁) that decodes to a space

    @classmethod
    def of(cls, decoder: dict | None, model_byte_fallback: bool) -> "DecoderScheme":
        steps = _flatten(decoder)
        kinds = {step.get("type") for step in steps}
        bad = sorted(kinds & set(_UNMAPPABLE_DECODERS))
        if bad:
            raise ValueError(f"cannot map tokens to bytes under a {bad[0]} "
                             "decoder (it inserts text between tokens)")
        marker = None
        for step in steps:
            if step.get("type") == "Metaspace":
                marker = step.get("replacement", "▁")
            elif step.get("type") == "Replace" and step.get("content") == " ":
                marker = step.get("pattern", {}).get("String", marker)
        return cls(byte_level="ByteLevel" in kinds,
                   byte_fallback="ByteFallback" in kinds or model_byte_fallback,
                   space_marker=marker)

    def token_bytes(self, piece: str, byte_decoder: dict[str, int]) -> bytes | None:
        """The bytes of a model-vocabulary token string, or None when it has no byte form."""
        if self.byte_level:
            try:
                return bytes(byte_decoder[c] for c in piece)
            except KeyError:
                return None
        if self.byte_fallback:
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        if self.space_marker:
            piece = piece.replace(self.space_marker, " ")
        return piece.encode("utf-8")


def _flatten(decoder: dict | None) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", []) for step in _flatten(inner)]
    return [decoder]


def scheme_of(backend: Any) -> DecoderScheme:
    """The scheme of a `tokenizers.Tokenizer` (a fast tokenizer's `backend_tokenizer`)."""
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
    return DecoderScheme.of(decoder, bool(getattr(backend.model, "byte_fallback", False)))


class TokenBytes:
    """Token id -> the bytes it adds to the text, for a transformers tokenizer: added tokens (and
    any a scheme cannot map) as their decoded text, as `tokenizer.decode([id])` spells them."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            self.scheme = scheme_of(backend) if backend is not None else None
        except ValueError:
            self.scheme = None
        self.backend = backend
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.byte_decoder = gpt2_byte_decoder()

    def __call__(self, token: int) -> bytes:
        if self.scheme is not None and token not in self.added:
            piece = self.backend.id_to_token(token)
            if piece is not None:
                raw = self.scheme.token_bytes(piece, self.byte_decoder)
                if raw is not None:
                    return raw
        return self.tokenizer.decode([token]).encode("utf-8")
