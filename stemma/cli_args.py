"""Command-line flags derived from dataclass fields, so options are never listed twice."""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields
from typing import Any


def _kind(cls: type, name: str) -> type | tuple[str, type]:
    """The flag's argparse type, or ("list", item type) for a repeatable flag."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint in (bool, int, float, str):
        return hint
    if bool in args:
        return bool
    for simple in (int, float, str):
        if simple in args:
            return simple
    if any(typing.get_origin(a) in (tuple, list) for a in args) or typing.get_origin(hint) in (tuple, list):
        inner = [t for a in args or [hint] for t in typing.get_args(a) if t is not Ellipsis]
        return ("list", int if int in inner else str)
    return str


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                       shown_defaults: dict[str, Any] | None = None) -> None:
    """Adds `--field-name` for each field; every default is None, meaning 'not given'.
    `shown_defaults` are the defaults the command applies in place of the dataclass's own."""
    group = parser.add_argument_group(cls.__name__)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _kind(cls, f.name)
        default = f.default if f.default is not MISSING else None
        default = (shown_defaults or {}).get(f.name, default)
        if isinstance(kind, tuple):
            group.add_argument(flag, type=kind[1], action="append", default=None,
                               help=f"repeatable (default: {default!r})")
        elif kind is bool:
            group.add_argument(flag, type=_bool, nargs="?", const=True, default=None,
                               help=f"true/false (default: {default})")
        else:
            group.add_argument(flag, type=kind, default=None, choices=f.metadata.get("choices"),
                               help=f"(default: {default})")


def collect(ns: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of `cls` that were given on the command line."""
    return {f.name: getattr(ns, f.name) for f in fields(cls)
            if f.name not in skip and getattr(ns, f.name, None) is not None}
