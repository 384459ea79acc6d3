"""Incremental detokenization with UTF-8 holdback and stop-string trimming.

Used by the in-process engine and by the gateway, so both produce the same text.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stemma.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is decoded from `prefix_offset`, a few tokens back, so tokenizers that drop a leading
    space when decoding from the middle still produce the right delta. A delta that ends in an
    incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it. Tokens go
    in one at a time, as vLLM takes them, so the text does not depend on how the ids come grouped
    (a held-back delta held text a later group then released).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True,
                 context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(context[-4:])  # a little prompt context for the first delta
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: Sequence[int]) -> str:
        out = []
        for token in token_ids:
            self.ids.append(token)
            out.append(self._delta(final=False))
        return "".join(out)

    def flush(self) -> str:
        """The held-back tail, incomplete characters included, once no more tokens will come."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if not full.startswith(prefix):  # a byte run decoded anew (byte fallback gives one U+FFFD
            prefix, full = "", self._decode(self.ids[self.read_offset:])  # per byte of a bad run)
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


class StopTextTracker:
    """Accumulates text, finds stop strings across token boundaries, and says how much is safe to
    stream: a tail that could still grow into a stop string is held back. The text ends where the
    first stop string starts, or with `keep`, where it ends."""

    def __init__(self, stops: Sequence[str], keep: bool = False):
        self.stops = tuple(stops)
        self.keep = keep
        self.text = ""
        self.streamed = 0
        self.stopped: str | None = None

    def add(self, delta: str, match: bool = True) -> str:
        """Adds a delta; returns the newly streamable text. After a stop matches, text is trimmed.
        With `match` False no stop string is looked for; once it is True again, only a stop that
        ends in new text counts (one held back before stays in the text)."""
        if self.stopped is not None:
            return ""
        before = len(self.text)
        self.text += delta
        hit = self._find(before) if match else None
        if hit is not None:
            self.text = self.text[:hit[0] + (len(hit[1]) if self.keep else 0)]
            self.stopped = hit[1]
            return self.flush()
        safe = len(self.text) - self._partial_tail()
        out, self.streamed = self.text[self.streamed:safe], max(self.streamed, safe)
        return out

    def flush(self) -> str:
        out, self.streamed = self.text[self.streamed:], len(self.text)
        return out

    def _find(self, before: int) -> tuple[int, str] | None:
        """The first stop string that ends past `before`."""
        best = None
        for stop in self.stops:
            i = self.text.find(stop, max(0, before - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _partial_tail(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class TextStream:
    """Token ids in, streamable text out: incremental detokenization plus stop-string trimming.
    The text of `stop_ids` is left out, as vLLM and SGLang leave a stop token's and EOS's: a
    request ends at such a token (the sampler bans them until min_new_tokens), so it can only be
    the output's last token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str] = (),
                 skip_special_tokens: bool = True, context: Sequence[int] = (),
                 stop_ids: Sequence[int] = (), keep_stop: bool = False, hold_stops: int = 0):
        """`hold_stops`: stop strings do not end the text within its first that many tokens
        (min_new_tokens, as vLLM holds them)."""
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context)
        self.stops = StopTextTracker(stops, keep_stop)
        self.stop_ids = frozenset(stop_ids)
        self.hold_stops = hold_stops
        self.pushed = 0  # tokens pushed so far

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, params: SamplingParams,
           context: Sequence[int], eos_token_ids: Sequence[int] = ()) -> TextStream:
        """The stream of a request's output text: its stop strings, special-token rule and the
        ids that end it (its stop token ids, and the model's `eos_token_ids` unless it ignores
        EOS), with the prompt `context` before the first token."""
        keep = params.include_stop_str_in_output
        ends = () if keep else (*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids))
        return cls(tokenizer, params.stop, params.skip_special_tokens, context, ends, keep,
                   params.min_new_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        held = min(len(token_ids), max(0, self.hold_stops - self.pushed))
        if 0 < held < len(token_ids):  # the text of the held tokens first, unmatched
            return self._push(token_ids[:held], False) + self._push(token_ids[held:], True)
        return self._push(token_ids, held == 0)

    def _push(self, token_ids: Sequence[int], match: bool) -> str:
        self.pushed += len(token_ids)
        if self.stop_ids:
            token_ids = [t for t in token_ids if t not in self.stop_ids]
        return self.stops.add(self.detok.push(token_ids), match)

    def finish(self) -> str:
        """Whatever was held back, once no more tokens will come."""
        return self.stops.add(self.detok.flush()) + self.stops.flush()

    @property
    def stopped(self) -> str | None:
        return self.stops.stopped

    @property
    def text(self) -> str:
        return self.stops.text
