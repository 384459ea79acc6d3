"""What a program's model calls cost, and how much of it the prefix cache served."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class CallRecord:
    """One request a program sent: `kind` is gen, select, prefill (fork, select, run_batch)."""
    kind: str
    name: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, kind: str, name: str | None, meta: dict[str, Any]) -> "CallRecord":
        return cls(kind, name, int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0)),
                   int(meta.get("completion_tokens", 0)))


@dataclass(frozen=True)
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, records: Iterable[CallRecord]) -> "Usage":
        total = cls()
        for r in records:
            total = total + cls(1, r.prompt_tokens, r.cached_tokens, r.completion_tokens)
        return total

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.calls + other.calls, self.prompt_tokens + other.prompt_tokens,
                     self.cached_tokens + other.cached_tokens,
                     self.completion_tokens + other.completion_tokens)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __str__(self) -> str:
        return (f"{self.calls} model calls, {self.prompt_tokens} prompt tokens of which "
                f"{self.cached_tokens} ({self.cache_hit_rate:.0%}) came from the prefix cache, "
                f"{self.completion_tokens} generated")


def total(usages: Iterable[Usage]) -> Usage:
    out = Usage()
    for u in usages:
        out = out + u
    return out
