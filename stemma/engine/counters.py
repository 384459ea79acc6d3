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
    preemptions: int = 0      # retractions for a higher-priority waiting request
    slo_give_way: int = 0     # retractions of lower priority to keep a step within its target
    busy_time: float = 0.0
