"""The program IR: what `s += ...` appends, whether it came from Python or from a text program.

A program is a sequence of nodes appended to a state. Python programs build the nodes at run time
(`s += "text"`, `s += gen("x")`); text programs (.stm) are compiled to the same nodes ahead of
time. The interpreter executes nodes in order, per state.

    Text("Q: ")                          append literal text
    VarRef("question", where)            append the value of a variable (text programs only)
    Gen("answer", (("max_new_tokens", 16),))  generate into variable `answer`
    Select("verdict", ("yes", "no"), method)  pick a choice by its logprobs
    RoleBegin("user") / RoleEnd("user")  open / close a chat turn, rendered by the chat template
    Concat((...))                        several nodes appended one after another

Nodes are frozen and hold plain values only, so a traced prefix can be compared and cached.
`+` between nodes and strings builds a Concat, so `s += "Q: " + gen("x")` works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, TypeAlias

ROLES = ("system", "user", "assistant")

# What gen(dtype=...), gen_int and gen_string constrain a value to (SGLang exports the same names
# from sglang.lang.ir). Numbers are JSON numbers, so a value goes into JSON as it is, with at most
# 18 digits before the point (an int64) and 15 after it: a model that would rather add digits
# than end the number (small models do) still ends it, and a space or newline after it ends the
# gen at once. A string is a JSON string without escapes.
REGEX_INT = r"-?(0|[1-9][0-9]{0,17})[ \n]?"
REGEX_FLOAT = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,15})?([eE][-+]?[0-9]{1,3})?[ \n]?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r'"[^"\\\x00-\x1f]*"'


@dataclass(frozen=True)
class Where:
    """A position in a text program, for error messages (1-based)."""
    line: int
    column: int
    source: str = "<program>"

    def __str__(self) -> str:
        return f"{self.source}:{self.line}:{self.column}"


class Node:
    """Base of every IR node."""

    def __add__(self, other: Content) -> "Concat":
        return Concat((self, as_node(other)))

    def __radd__(self, other: Content) -> "Concat":
        return Concat((as_node(other), self))

    def flatten(self) -> Iterator["Node"]:
        yield self


@dataclass(frozen=True)
class Text(Node):
    value: str


@dataclass(frozen=True)
class VarRef(Node):
    name: str
    where: Where | None = None


@dataclass(frozen=True)
class Gen(Node):
    name: str | None
    params: tuple[tuple[str, Any], ...] = ()  # SamplingParams fields given here, sorted by name

    @property
    def overrides(self) -> Mapping[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class Select(Node):
    name: str | None
    choices: tuple[str, ...]
    method: str


@dataclass(frozen=True)
class RoleBegin(Node):
    role: str


@dataclass(frozen=True)
class RoleEnd(Node):
    role: str


@dataclass(frozen=True)
class Concat(Node):
    parts: tuple[Node, ...]

    def flatten(self) -> Iterator[Node]:
        for part in self.parts:
            yield from part.flatten()


Content: TypeAlias = "Node | str"  # what a program appends: a node, or text


def as_node(value: Content) -> Node:
    """A node for what `s += value` was given: a node, or a string (as Text)."""
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program appends text or stemma expressions (gen, select, roles), "
                    f"got {type(value).__name__}: {value!r}")


def sets_variable(node: Node) -> str | None:
    """The variable a node writes, if any."""
    if isinstance(node, (Gen, Select)):
        return node.name
    return None
