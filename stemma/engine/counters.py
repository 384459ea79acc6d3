"""What an engine has done so far, for `Engine.stats()`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    busy_time: float = 0.0
