"""What a request says about the program that sent it: the optional program context on the wire.

A frontend program (stemma.function, an agent loop) makes many calls to the model. Each call may
carry a `ProgramCall`: which program instance sent it, its index among that program's calls,
the call it forked from, and hints about what comes next. A program-aware engine
(`schedule_policy="program"`, `radix_eviction="program"`) uses it to order the queue by the
program's attained service and to keep a paused program's KV cached until it calls again; a
request without it is scheduled and cached as before. Torch-free, like SamplingParams, and
checked once, in `__post_init__`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from stemma.sampling_params import _check_bool, _check_int, _check_real

MAX_PROGRAM_ID_CHARS = 256
MAX_PAUSE_S = 3600.0


@dataclass(frozen=True)
class ProgramCall:
    program_id: str                 # one program instance (a run), unique among the server's clients
    call_index: int = 0             # this call's place among the program's calls, from 0
    fork_parent: int | None = None  # the call_index of the call this branch forked after
    continues: bool = True          # the program will call again (False: its last call)
    pause_s: float | None = None    # the expected pause (a tool call) before its next call

    def __post_init__(self):
        if not isinstance(self.program_id, str) or not 0 < len(self.program_id) <= MAX_PROGRAM_ID_CHARS:
            raise ValueError(f"program_id must be a string of 1 to {MAX_PROGRAM_ID_CHARS} characters, "
                             f"got {self.program_id!r}")
        _check_int("call_index", self.call_index, 0)
        if self.fork_parent is not None:
            _check_int("fork_parent", self.fork_parent, 0)
            if self.fork_parent >= self.call_index:
                raise ValueError(f"fork_parent must be an earlier call than call_index {self.call_index}, "
                                 f"got {self.fork_parent}")
        _check_bool("continues", self.continues)
        if self.pause_s is not None:
            _check_real("pause_s", self.pause_s, 0.0, MAX_PAUSE_S)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProgramCall:
        """Raises ValueError on unknown or invalid fields."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown program call fields: {', '.join(map(str, unknown))}")
        if "program_id" not in data:
            raise ValueError("a program call needs program_id")
        return cls(**data)
