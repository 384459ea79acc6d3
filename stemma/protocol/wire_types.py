"""Checking a decoded msgpack value against a type hint, for the protocol codec.

msgpack yields only None, bool, int, float, str, bytes, list and dict. `coerce` walks a value and
its hint together and raises `WireTypeError` naming the offending field, so a malformed frame
becomes a clear error reply instead of a crash deep inside the engine. Fixed-length tuple hints
turn lists into tuples; classes outside the plain types are handed to `custom`.
"""
from __future__ import annotations

import types
import typing
from typing import Any, Callable

Custom = Callable[[Any, type, str], Any]


class WireTypeError(ValueError):
    """A decoded value does not have the type its field declares."""


def describe(hint: Any) -> str:
    if hint is type(None):
        return "nil"
    if hint is Any:
        return "any value"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint))
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(describe(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def _fail(hint: Any, value: Any, where: str) -> typing.NoReturn:
    raise WireTypeError(f"{where} must be {describe(hint)}, got {type(value).__name__}")


def _scalar(value: Any, hint: type, where: str) -> Any:
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, hint)
    if not ok:
        _fail(hint, value, where)
    return value


def _union(value: Any, args: tuple, where: str, custom: Custom | None) -> Any:
    if value is None:
        if type(None) in args:
            return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, where, custom)
        except WireTypeError as exc:
            errors.append(str(exc))
    if len(errors) == 1:
        raise WireTypeError(errors[0])
    _fail(typing.Union[args], value, where)


def _sequence(value: Any, hint: Any, where: str, custom: Custom | None) -> Any:
    if not isinstance(value, list):
        _fail(hint, value, where)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        (item,) = args or (Any,)
        if item is Any:
            return value
        return [coerce(v, item, f"{where}[{i}]", custom) for i, v in enumerate(value)]
    if len(value) != len(args):
        raise WireTypeError(f"{where} must hold {len(args)} items, got {len(value)}")
    return tuple(coerce(v, a, f"{where}[{i}]", custom) for i, (v, a) in enumerate(zip(value, args)))


def _mapping(value: Any, hint: Any, where: str, custom: Custom | None) -> dict:
    if not isinstance(value, dict):
        _fail(hint, value, where)
    key_hint, value_hint = typing.get_args(hint) or (Any, Any)
    return {coerce(k, key_hint, f"{where} key", custom): coerce(v, value_hint, f"{where}[{k!r}]", custom)
            for k, v in value.items()}


def coerce(value: Any, hint: Any, where: str, custom: Custom | None = None) -> Any:
    """`value` checked against `hint` (and converted where the hint asks); raises WireTypeError."""
    if hint is Any:
        return value
    if hint is type(None):
        if value is not None:
            _fail(hint, value, where)
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union(value, typing.get_args(hint), where, custom)
    if origin in (list, tuple):
        return _sequence(value, hint, where, custom)
    if origin is dict:
        return _mapping(value, hint, where, custom)
    if hint in (bool, int, float, str, bytes):
        return _scalar(value, hint, where)
    if custom is None:
        raise TypeError(f"{where}: no rule to decode {describe(hint)}")
    return custom(value, hint, where)
