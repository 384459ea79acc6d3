"""When a request is done: EOS, stop token ids, stop strings, max_new_tokens, the context."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stemma.text.detokenizer import TextStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stemma.engine.request import Request


@dataclass(frozen=True)
class StopRule:
    eos_token_ids: tuple[int, ...]
    max_context: int
    tokenizer: PreTrainedTokenizerBase | None = None  # None: stop strings are not matched

    def check(self, req: Request, token: int) -> str | None:
        """The finish reason after `token` was appended to req, or None to keep going.

        EOS and stop_token_ids are banned by the sampler until min_new_tokens; stop strings are
        matched on the detokenized text across token boundaries (the text is trimmed there).
        """
        p = req.params
        stream = None
        if p.stop and self.tokenizer is not None:  # every token goes in, the one that ends it too:
            stream = stop_stream(req, self.tokenizer, self.eos_token_ids)  # the output's text is
            stream.push([token])                                     # this stream's (Engine._text)
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if stream is not None and stream.stopped is not None:
            req.stop_reason = stream.stopped
            return "stop"
        if len(req.output_ids) >= p.max_new_tokens or len(req.tokens) >= self.max_context:
            return "length"
        return None


def stop_stream(req: Request, tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> TextStream:
    """The request's text stream, made on first use (it keeps across retractions)."""
    if req.stop_tracker is None:
        req.stop_tracker = TextStream.of(tokenizer, req.params, req.input_ids, eos_token_ids)
        req.stop_tracker.push(req.output_ids[:-1])
    return req.stop_tracker
