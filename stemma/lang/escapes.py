"""The one escape rule for text a person types: Python's backslash escapes, read where they mean
something, kept as typed where they do not.

It applies to the CLI's prompt and text flags (`--stop`, `--var`), to REPL inputs, and to `.stm`
programs, text and quoted values alike:

    \\n \\t \\r \\0 \\a \\b \\f \\v   the control characters      \\\\   a backslash
    \\" \\'                    a quote                     \\xNN \\uNNNN \\UNNNNNNNN \\N{name}   a character

A backslash before anything else stays a backslash (so `\\d` reaches a regex as `\\d`), and so
does one that ends the text. Patterns given as flags (`--regex`, `--grammar`, `--json-schema`)
are not read this way: they have escapes of their own.
"""
from __future__ import annotations

import re
import unicodedata

_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "a": "\a", "b": "\b", "f": "\f",
           "v": "\v", "\\": "\\", '"': '"', "'": "'"}
_ESCAPE = re.compile(r"\\(?:([ntr0abfv\\\"'])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})"
                     r"|U([0-9a-fA-F]{8})|N\{([^{}]+)\})")


def _one(match: re.Match) -> str:
    simple, *codes, name = match.groups()
    if simple is not None:
        return _SIMPLE[simple]
    for code in codes:
        if code is not None:
            value = int(code, 16)
            return chr(value) if value <= 0x10FFFF else match.group(0)
    try:
        return unicodedata.lookup(name)
    except KeyError:
        return match.group(0)


def unescape(text: str) -> str:
    """`text` with its escapes read (see the module's rule); the rest unchanged."""
    return _ESCAPE.sub(_one, text) if "\\" in text else text
