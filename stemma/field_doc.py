"""Dataclass fields that carry their own help text, so the Python API and the CLI say one thing.

    temperature: float = doc(1.0, "0 means greedy")
    batching: str = one_of("continuous", BATCHING, "how requests form batches")

`doc` and `one_of` are `dataclasses.field` with metadata; the `stemma` command's flags read it
(stemma.cli_args): `help` is the flag's description, `choices` the values a field accepts (checked
in the dataclass's `__post_init__` and by argparse), `values` the names to list where a field also
takes other forms (dtype takes a torch.dtype too, so its names are listed, not enforced here).
"""
from __future__ import annotations

from dataclasses import Field, field
from typing import Any, Sequence


def doc(default: Any, help: str, *, values: Sequence[str] | None = None) -> Any:
    """A field with a default and its help text (and, optionally, the names it accepts)."""
    metadata: dict[str, Any] = {"help": help}
    if values is not None:
        metadata["values"] = tuple(values)
    return field(default=default, metadata=metadata)


def one_of(default: str | int, names: Sequence[str | int], help: str) -> Any:
    """A field whose value must be one of `names`: validated in __post_init__, and argparse
    `choices` for its flag."""
    return field(default=default, metadata={"choices": tuple(names), "help": help})


def help_of(f: Field) -> str | None:
    """The help text of a dataclass field; None for a field declared without one."""
    return f.metadata.get("help")
