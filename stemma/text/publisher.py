"""What a request produced since it was last published: its new token ids and, with a text
stream, their text. The one way new output ids become deltas, used by `Engine.stream`, the
engine process (ids only) and the frontend's in-process backend."""
from __future__ import annotations

from collections.abc import Sequence

from stemma.text.detokenizer import TextStream


class Publisher:
    """Invariant: `sent` output tokens have been published, in order, each exactly once."""

    def __init__(self, text: TextStream | None = None):
        self.sent = 0
        self.text = text

    def take(self, output_ids: Sequence[int]) -> slice | None:
        """The positions of `output_ids` not published yet (now published), or None if none."""
        if len(output_ids) <= self.sent:
            return None
        new = slice(self.sent, len(output_ids))
        self.sent = len(output_ids)
        return new

    def push(self, output_ids: Sequence[int]) -> str:
        """The text delta of the tokens not published yet ('' while held back, or none new)."""
        new = self.take(output_ids)
        return self.text.push(output_ids[new]) if new is not None else ""

    def finish(self) -> str:
        """Whatever text was held back, once no more tokens will come."""
        return self.text.finish()
