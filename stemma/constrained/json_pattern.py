"""A JSON schema's `pattern` and `format` as the regex outlines-core puts between a string's quotes.

outlines-core pastes a pattern between the quotes as it is. A `.`, a negated class or `\\s` there
can write `"`, a backslash or a control character into the JSON, which then does not parse; and its
`\\d` and `\\w` match any Unicode digit or letter, where JSON Schema's (ECMA-262's) match ASCII only.
So a pattern's `\\d` and `\\w` are written out as their ASCII classes and `\\s` as ECMA's blanks that
a JSON string holds as they are (its tab and line breaks would need escapes), and a pattern that can
still match one of those characters is refused, naming the keyword. The string matches the
pattern whole: a leading `^` and a trailing `$` are dropped, any other anchor is refused. Its own
regexes for the formats have the same faults (`\\d`; a `time` whose fraction is a literal
backslash), so the formats kept are written here; the others are refused.
"""
from __future__ import annotations

try:
    import re._constants as C
    import re._parser as parser
except ImportError:  # Python < 3.11
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as parser  # type: ignore[no-redef]

BLANKS = " \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"  # ECMA's \s, no controls
ASCII_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_", "s": BLANKS}
UNWRITABLE = frozenset([ord('"'), ord("\\"), *range(0x20)])  # raw in a JSON string

_DATE = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {  # RFC 3339 (a time has its offset), RFC 4122
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}


def format_pattern(fmt: str, where: str) -> str:
    """The pattern a string of format `fmt` is decoded by."""
    if fmt not in FORMATS:
        raise ValueError(f"json_schema at {where}: format {fmt!r} is not supported (supported: "
                         f"{', '.join(sorted(FORMATS))}); give a 'pattern' instead")
    return FORMATS[fmt]


def string_pattern(pattern: str, where: str) -> str:
    """`pattern` with ASCII classes, checked to write only what a JSON string holds raw."""
    try:
        rewritten = ascii_classes(pattern)
        parsed = parser.parse(rewritten)
    except Exception as exc:  # re.error, or the parser's own faults on odd input
        raise ValueError(f"json_schema at {where}: 'pattern' is not a regex: {exc}") from None
    if _may_write_unwritable(list(parsed)):
        raise ValueError(f"json_schema at {where}: 'pattern' {pattern!r} can match '\"', a "
                         "backslash or a control character (through '.', a negated class, \\s, "
                         "\\D, \\W or \\S, or as written), which a JSON string cannot hold as "
                         "they are; name the characters it allows")
    return _unanchored(rewritten, list(parsed), pattern, where)


def _unanchored(rewritten: str, items: list, pattern: str, where: str) -> str:
    """`rewritten` without a leading `^` and a trailing `$`: the string matches the pattern whole
    anyway, as `^...$` asks. Any other anchor is refused: between the quotes it could never be
    met, so an output could never end (`[a-z]+$` went into the regex as `"[a-z]+$"`)."""
    if items[:1] == [(C.AT, C.AT_BEGINNING)]:
        rewritten, items = rewritten[1:], items[1:]
    if items[-1:] == [(C.AT, C.AT_END)]:
        rewritten, items = rewritten[:-1], items[:-1]
    if _has_anchor(items):
        raise ValueError(f"json_schema at {where}: 'pattern' {pattern!r} has an anchor or a word "
                         "boundary other than a leading '^' and a trailing '$'; the string "
                         "matches the pattern whole, so write it without one")
    return rewritten


def _has_anchor(items: list) -> bool:
    return any(op is C.AT or any(_has_anchor(part) for part in _inner(op, arg) or ())
               for op, arg in items)


def ascii_classes(pattern: str) -> str:
    """`\\d`, `\\w` and `\\s` written out (inside a class or as one); everything else as given.
    Raises ValueError on what outlines-core's (Rust) syntax reads in a class and Python's does
    not, so that the check would pass a pattern it reads otherwise: a nested class or a POSIX
    one (`[[:print:]]` holds '"'), and the set operators `&&`, `--`, `~~`."""
    out, i, n, in_class = [], 0, len(pattern), False
    while i < n:
        ch = pattern[i]
        if in_class and (ch == "[" or pattern[i:i + 2] in ("&&", "--", "~~")):
            raise ValueError(f"a class holds {pattern[i:i + 2] if ch != '[' else '['!r} at {i}, which "
                             "outlines-core reads as a nested class or a set operation; escape it")
        if ch == "\\" and i + 1 < n:
            body = ASCII_CLASSES.get(pattern[i + 1])
            out.append(pattern[i:i + 2] if body is None else body if in_class else f"[{body}]")
            i += 2
        elif ch == "[" and not in_class:
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"  # a leading ] is a literal
            out.append(pattern[i:j])
            in_class, i = True, j
        else:
            in_class = in_class and ch != "]"
            out.append(ch)
            i += 1
    return "".join(out)


def _may_write_unwritable(items: list) -> bool:
    for op, arg in items:
        inner = _inner(op, arg)
        if inner is not None:
            if any(_may_write_unwritable(part) for part in inner):
                return True
        elif op is C.LITERAL:
            if arg in UNWRITABLE:
                return True
        elif op in (C.NOT_LITERAL, C.ANY):
            return True
        elif op is C.IN:
            if _class_may_hold_unwritable(arg):
                return True
        elif op is not C.AT:
            return True  # lookarounds, back references, conditionals: not taken apart here
    return False


def _inner(op, arg) -> list[list] | None:
    """The item lists inside a repeat, a group or an alternation; None for any other item."""
    if op in (C.MAX_REPEAT, C.MIN_REPEAT) or op is getattr(C, "POSSESSIVE_REPEAT", None):
        return [list(arg[2])]
    if op is C.SUBPATTERN:
        return [list(arg[3])]
    if op is C.BRANCH:
        return [list(branch) for branch in arg[1]]
    if op is getattr(C, "ATOMIC_GROUP", None):
        return [list(arg)]
    return None


def _class_may_hold_unwritable(items: list) -> bool:
    for op, arg in items:
        if op is C.NEGATE:
            return True
        if op is C.LITERAL and arg in UNWRITABLE:
            return True
        if op is C.RANGE and any(arg[0] <= c <= arg[1] for c in UNWRITABLE):
            return True
        if op is C.CATEGORY and arg not in (C.CATEGORY_DIGIT, C.CATEGORY_WORD):
            return True  # \s holds controls; \D, \W, \S hold anything
    return False
