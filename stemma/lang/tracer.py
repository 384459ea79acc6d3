"""Tracing: the constant prefix of a program, the text every run of it starts with.

The body is run once on a TracingState with a Placeholder for every argument. Constant text and
roles are recorded. The first thing that depends on an argument or on the model (using a
placeholder, a gen, a select, a read, a fork) ends the trace. run_batch prefills the rendered
prefix once, so every program of the batch finds it in the cache.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from stemma.lang.chat_template import ChatTemplate
from stemma.lang.ir import Content, Node, RoleBegin, RoleEnd, Text, as_node
from stemma.lang.roles import RoleMethods
from stemma.lang.tool import tracing


class StopTracing(Exception):
    """The traced body did something that is not constant."""


class Placeholder:
    """Stands for an argument while tracing; any use of it ends the trace."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _stop(self, *args: Any, **kwargs: Any):
        raise StopTracing(f"argument {self._name!r} is used")

    __str__ = __format__ = __add__ = __radd__ = __mod__ = __rmod__ = __mul__ = _stop
    __iter__ = __len__ = __bool__ = __getitem__ = __eq__ = __lt__ = __gt__ = __contains__ = _stop
    __int__ = __float__ = __call__ = __index__ = _stop
    __hash__ = None

    def __getattr__(self, name: str):
        self._stop()

    def __repr__(self) -> str:
        return f"<argument {self._name}>"


_CONSTANT = (Text, RoleBegin, RoleEnd)


class TracingState(RoleMethods):
    """Records the constant nodes appended to it; anything else stops the trace."""

    def __init__(self):
        self.nodes: list[Node] = []

    def __iadd__(self, value: Content | Placeholder) -> "TracingState":
        if isinstance(value, Placeholder):
            value._stop()
        for node in as_node(value).flatten():
            if not isinstance(node, _CONSTANT):
                raise StopTracing(f"{type(node).__name__} depends on the model")
            self.nodes.append(node)
        return self

    # var_scope appends nothing itself (RoleMethods append constant nodes): traced through
    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        yield

    def __getattr__(self, name: str):
        raise StopTracing(f"state.{name} is not constant")

    def __getitem__(self, name: str):
        raise StopTracing(f"reading {name!r} waits for the model")


@dataclass(frozen=True)
class Trace:
    nodes: tuple[Node, ...]

    def render(self, template: ChatTemplate) -> str:
        """The prefix as text, roles rendered by `template`."""
        parts = []
        for node in self.nodes:
            if isinstance(node, Text):
                parts.append(node.value)
            elif isinstance(node, RoleBegin):
                parts.append(template.prefix(node.role))
            elif isinstance(node, RoleEnd):
                parts.append(template.suffix(node.role))
        return "".join(parts)


def placeholders(body: Callable[..., Any]) -> dict[str, Placeholder]:
    """A placeholder for each named parameter after the state."""
    params = list(inspect.signature(body).parameters.values())[1:]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: Placeholder(p.name) for p in params if p.kind in named}


def trace(body: Callable[..., Any], args: dict[str, Any] | None = None) -> Trace:
    """The constant prefix of `body` called with `args` (placeholders for all by default)."""
    state = TracingState()
    try:
        with tracing():  # a stemma.tool call ends the trace instead of running
            result = body(state, **(placeholders(body) if args is None else args))
            if inspect.iscoroutine(result):  # an async body: run it up to its first real await
                try:
                    result.send(None)
                finally:
                    result.close()
    except Exception:  # StopTracing, or another failure caused by a placeholder: either way the
        pass           # prefix ends here, and a real error is raised by the real run
    return Trace(tuple(state.nodes))
