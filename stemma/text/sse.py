"""Server-sent events read line by line, for the clients of HTTP servers (stemma's own and any
OpenAI-compatible one)."""
from __future__ import annotations


class SSE:
    """Server-sent events, line by line: `feed` returns an event's data at the blank line that
    ends it (several data lines are joined with newlines), else None."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # comments, event names, ids, retry hints

    def flush(self) -> str | None:
        return self.feed("")
