"""Jump-forward: where the constraint allows exactly one continuation, append it without sampling.

After a constrained request samples token `t`, the guide may force some bytes (`{"name": "` after
`{` in a JSON schema). They are appended as tokens, and the next step extends all of them at once.

The boundaries are re-tokenized, as SGLang's compressed FSM did, so the model sees the tokens its
tokenizer would have written:

    sampled   t = `{`              forced `"name": "`
    joined    `{"name": "`  ->  tokenize  ->  `{"` `name` `":` ` "`
    kept      `{"` `name` `":`             (` "` is held back)

- start: `t` and the forced bytes are tokenized together, so a merge across the boundary comes
  out right. Only `t` is replaced: as the last sampled token it has no KV yet, so nothing computed
  is thrown away.
- end: the last token is held back, since it might merge with the free text that follows; the
  model samples it (or a longer token that starts with it) next step, under the mask. When the
  constraint ends with the forced bytes, nothing is held back and the request is done.

A tokenization that does not spell the joined bytes back exactly (a tokenizer that adds a prefix
space, say) is not used; nothing is forced then.
"""
from __future__ import annotations

from typing import Callable

from stemma.constrained.guide import Guide
from stemma.constrained.vocab import TokenVocab

FORCED_BYTES_LIMIT = 128


def plan(guide: Guide, token: int, vocab: TokenVocab, encode: Callable[[str], list[int]],
         limit: int = FORCED_BYTES_LIMIT) -> list[int] | None:
    """The tokens to put in place of `token` (already accepted by `guide`), with the guide advanced
    past them; None (and the guide untouched) when nothing is forced."""
    forced = guide.forced_bytes(limit)
    if not forced:
        return None
    head = vocab.token_bytes[token] or b""
    text = whole_utf8(head + forced)
    if len(text) <= len(head):
        return None
    ids = encode(text.decode("utf-8"))
    if not ids or vocab.decode(ids) != text:
        return None
    guide.rollback(1)
    accepted = guide.accept_many(ids)
    if accepted == len(ids) and guide.is_terminated():
        return ids
    keep = len(ids) - 1
    if accepted < len(ids) or len(vocab.decode(ids[:keep])) <= len(head):
        guide.rollback(accepted)  # nothing gained over the sampled token: put it back
        if not guide.accept(token):
            raise RuntimeError(f"guide refused token {token} it had accepted: {guide.error}")
        return None
    guide.rollback(1)
    return ids[:keep]


def whole_utf8(data: bytes) -> bytes:
    """The longest prefix of `data` that is whole UTF-8 characters."""
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError as exc:
        return data[:exc.start]
