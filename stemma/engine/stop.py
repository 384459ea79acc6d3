"""When a request is done: EOS, stop token ids, stop strings, max_new_tokens, the context."""
from __future__ import annotations

from typing import Any

from stemma.text.detokenizer import TextStream
from stemma.engine.request import Request


def check_finish(req: Request, token: int, eos_token_ids: tuple[int, ...], max_context: int,
                 tokenizer: Any) -> str | None:
    """The finish reason after `token` was appended to req, or None to keep going.

    EOS and stop_token_ids are banned by the sampler until min_new_tokens; stop strings are
    matched on the detokenized text across token boundaries (the text is trimmed there).
    """
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return "stop"
    if p.stop and tokenizer is not None:
        stream = stop_stream(req, tokenizer)
        stream.push([token])
        if stream.stopped is not None:
            return "stop"
    if len(req.output_ids) >= p.max_new_tokens or len(req.tokens) >= max_context:
        return "length"
    return None


def stop_stream(req: Request, tokenizer: Any) -> TextStream:
    """The request's text stream, made on first use (it keeps across retractions)."""
    if req.stop_tracker is None:
        req.stop_tracker = TextStream(tokenizer, req.params.stop, req.params.skip_special_tokens,
                                      req.input_ids)
        req.stop_tracker.push(req.output_ids[:-1])
    return req.stop_tracker
