"""Command-line flags derived from dataclass fields, so options are never listed twice.

Each field becomes `--field-name`; its help text is the field's own (stemma.field_doc), with its
choices and the default the command applies. Every flag's default is None, meaning "not given",
so the dataclass's own default (or the command's) applies. List fields take lists:
  - token ids: `--stop-token-ids 1 2`, `--stop-token-ids 1,2`, and repeated flags all add up;
  - strings, one per flag, repeatable: `--stop . --stop XYZ` (one value each, so that a list
    never swallows the prompt after it); their backslash escapes are read (lang.escapes);
  - logit bias: `--logit-bias 123=-5 456=2.5`.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Any, Sequence

from stemma.field_doc import help_of
from stemma.lang.escapes import unescape

# SGLang's and OpenAI's names, accepted beside stemma's (as .stm accepts max_tokens)
ALIASES = {"max_new_tokens": ("--max-tokens",), "min_new_tokens": ("--min-tokens",)}
# flag -> its kind ("bool", "ints", "biases"; "mixed" where subcommands differ): the flags whose
# values Parser makes explicit, so that they never take the positional argument after them
_VALUE_FLAGS: dict[str, str] = {}


def _kind(cls: type, name: str) -> type | str:
    """The flag's argparse type: bool, int, float or str; or "ints", "strings" or "biases" for a
    list field (checked before the scalars: `stop` is `tuple[str, ...] | str | ...`)."""
    hint = typing.get_type_hints(cls)[name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    if any(typing.get_origin(m) is dict for m in members):
        return "biases"
    lists = [m for m in members if typing.get_origin(m) in (tuple, list)]
    if lists:
        items = [t for m in lists for t in typing.get_args(m) if t is not Ellipsis]
        return "ints" if int in items else "strings"
    for simple in (bool, int, float, str):
        if simple in members:
            return simple
    return str


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _ints(text: str) -> list[int]:
    """One flag value of a token-id list: `7` or `7,8`."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids (7 or 7,8), got {text!r}") from None


def _bias(text: str) -> list[tuple[int, float]]:
    """One flag value of a logit bias: `ID=BIAS`."""
    token, eq, bias = text.partition("=")
    try:
        if eq:
            return [(int(token), float(bias))]
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {text!r}")


class _Extend(argparse.Action):
    """Adds each value's items to the list the flag has so far (across repeated flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        for value in values:
            items.extend(value)
        setattr(namespace, self.dest, items)


def _help(f: Field, default: Any, kind: type | str) -> str:
    """The field's description, then what the flag takes and its default (when it has one to
    show: a default of None is 'not given', which the description explains)."""
    text = help_of(f) or f.name.replace("_", " ")
    notes = {"ints": "one or more token ids, repeatable", "biases": "ID=BIAS pairs, repeatable",
             "strings": "repeatable, one value each; \\n and other escapes are read",
             bool: "true/false; the bare flag means true"}.get(kind)
    if notes:
        text += f" [{notes}]"
    if default is not None and default != ():
        text += f" (default: {'true' if default is True else 'false' if default is False else default})"
    return text.replace("%", "%%")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                       shown_defaults: dict[str, Any] | None = None) -> None:
    """Adds `--field-name` for each field; every default is None, meaning 'not given'.
    `shown_defaults` are the defaults the command applies in place of the dataclass's own."""
    group = parser.add_argument_group(cls.__name__)
    for f in fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
        kind = _kind(cls, f.name)
        default = f.default if f.default is not MISSING else None
        default = (shown_defaults or {}).get(f.name, default)
        common = dict(dest=f.name, default=None, help=_help(f, default, kind))
        for flag in flags:
            named = "bool" if kind is bool else kind if kind in ("ints", "biases") else "other"
            _VALUE_FLAGS[flag] = named if _VALUE_FLAGS.get(flag, named) == named else "mixed"
        if kind == "ints":
            group.add_argument(*flags, type=_ints, nargs="+", action=_Extend, metavar="ID", **common)
        elif kind == "biases":
            group.add_argument(*flags, type=_bias, nargs="+", action=_Extend, metavar="ID=BIAS", **common)
        elif kind == "strings":
            group.add_argument(*flags, type=unescape, action="append", metavar="TEXT", **common)
        elif kind is bool:
            group.add_argument(*flags, type=_bool, nargs="?", const=True, metavar="BOOL", **common)
        else:
            choices = f.metadata.get("choices") or f.metadata.get("values")
            group.add_argument(*flags, type=kind, choices=choices, **common)


def collect(ns: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of `cls` that were given on the command line."""
    return {f.name: getattr(ns, f.name) for f in fields(cls)
            if f.name not in skip and getattr(ns, f.name, None) is not None}


def unknown_options(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The error for arguments `parser` did not take: each unknown option with the closest
    option it has (difflib), or the stray arguments when none of them is an option."""
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    parts = []
    for arg in extras:
        if not arg.startswith("-") or arg == "-":
            continue
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        parts.append(f"unknown option {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
    if not parts:
        return f"unrecognized arguments: {' '.join(extras)}"
    return "; ".join(parts) + f"; see {parser.prog} --help"


def _parses(text: str, parse) -> bool:
    try:
        parse(text)
        return True
    except argparse.ArgumentTypeError:
        return False


def explicit_values(args: list[str]) -> list[str]:
    """`args` with the values of true/false and list flags written into them (`--flag=value`),
    so that argparse never gives such a flag the PROMPT or PROGRAM after it: a true/false flag
    takes the next argument only when it is true or false (else it means true), a list flag the
    next ones while they are token ids (ID=BIAS pairs). After `--`, nothing changes."""
    out, i = [], 0
    while i < len(args):
        token = args[i]
        i += 1
        kind = _VALUE_FLAGS.get(token)
        if token == "--":
            return out + [token, *args[i:]]
        if kind == "bool":
            if i < len(args) and _parses(args[i], _bool):
                out.append(f"{token}={args[i]}")
                i += 1
            else:
                out.append(f"{token}=true")
        elif kind in ("ints", "biases"):
            parse = _ints if kind == "ints" else _bias
            values = []
            while i < len(args) and _parses(args[i], parse):
                values.append(args[i])
                i += 1
            out += [f"{token}={v}" for v in values] or [token]  # none: argparse says what is missing
        else:
            out.append(token)
    return out


class Parser(argparse.ArgumentParser):
    """argparse, with a "did you mean" for an unknown option, reported by the subcommand that
    got it; its value never silently becomes a positional argument, since any unknown option is
    an error."""

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(explicit_values(sys.argv[1:] if args is None else list(args)),
                                           namespace)
        if extras:
            self._leaf(ns).error(unknown_options(self._leaf(ns), extras))
        return ns

    def _leaf(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser that `ns` came from (this one when it has none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(ns, action.dest, None)
                if name in action.choices:
                    return action.choices[name]._leaf(ns)
        return self
