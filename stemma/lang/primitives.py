"""What programs append: gen, select and the chat roles. Each returns an IR node, checked at once."""
from __future__ import annotations

from typing import Any, Sequence

from stemma.lang.ir import Concat, Content, Gen, Node, RoleBegin, RoleEnd, Select, as_node
from stemma.lang.scoring import DEFAULT_METHOD, METHODS
from stemma.sampling_params import SamplingParams

# Fields that are the program's business, not a gen's: one continuation per gen (fork for more),
# and prompt logprobs are what select uses.
_NOT_FOR_GEN = ("n", "logprob_start")


def gen(name: str | None = None, **params: Any) -> Gen:
    """Generates into variable `name`. `params` are SamplingParams fields (max_new_tokens,
    temperature, stop, ...); they override the run's defaults for this call only."""
    _check_name(name, "gen")
    for field in _NOT_FOR_GEN:
        if field in params:
            raise ValueError(f"gen does not take {field!r}" +
                             (": fork the state for several continuations" if field == "n" else ""))
    checked = SamplingParams.from_dict(params)  # checks names and values where the program says them
    return Gen(name, tuple(sorted((k, getattr(checked, k)) for k in params)))  # normalized values


def select(name: str | None, choices: Sequence[str], method: str = DEFAULT_METHOD) -> Select:
    """Picks one of `choices` by its logprobs given the program so far, and appends it.
    `method` is one of scoring.METHODS."""
    _check_name(name, "select")
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"select {name!r}: choices must be a list of strings, got {choices!r}")
    if not choices:
        raise ValueError(f"select {name!r}: choices must not be empty")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"select {name!r}: every choice must be a non-empty string, got {choice!r}")
    if method not in METHODS:
        raise ValueError(f"select {name!r}: method must be one of {', '.join(METHODS)}, got {method!r}")
    return Select(name, tuple(choices), method)


def _check_name(name: str | None, what: str) -> None:
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        raise ValueError(f"{what}: a variable name must be an identifier, got {name!r}")


def _role(role: str, content: tuple[Content, ...]) -> Node:
    return Concat((RoleBegin(role), *(as_node(c) for c in content), RoleEnd(role)))


def system(*content: Content) -> Node:
    """A system turn holding `content` (text, gen, select, ...)."""
    return _role("system", content)


def user(*content: Content) -> Node:
    return _role("user", content)


def assistant(*content: Content) -> Node:
    return _role("assistant", content)


def system_begin() -> Node:
    return RoleBegin("system")


def system_end() -> Node:
    return RoleEnd("system")


def user_begin() -> Node:
    return RoleBegin("user")


def user_end() -> Node:
    return RoleEnd("user")


def assistant_begin() -> Node:
    return RoleBegin("assistant")


def assistant_end() -> Node:
    return RoleEnd("assistant")
