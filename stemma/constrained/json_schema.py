"""JSON schema -> the regex outlines-core decodes by, refusing what it would not enforce.

outlines-core turns a schema into a regex, but it silently drops some keywords (integer bounds,
`multipleOf`, `uniqueItems`, a `pattern` beside a length), and an output that ignores them would not
validate. So a schema is checked in three passes, each error naming the keyword and where it is:

1. it must be a valid schema (`jsonschema`'s metaschema check);
2. every keyword must be one that is enforced, or a pure annotation (title, description, ...);
3. integer `minimum`/`maximum`/`exclusive*` are rewritten to a placeholder constant, and the
   placeholder in outlines' regex is replaced with an exact range regex (int_range).

The JSON is compact: no whitespace between tokens (outlines' default allows an optional space at
each one). Every key and separator is then forced text, which jump-forward appends unsampled, and a
model cannot pad its output with blanks.
"""
from __future__ import annotations

import json
import math
from typing import Any

from stemma.constrained.int_range import int_range_regex

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly"})
ENFORCED = frozenset({"type", "properties", "required", "additionalProperties", "items",
                      "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf", "oneOf",
                      "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern",
                      "format"})
INT_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_PLACEHOLDER = "__stemma_int_{}__"
WHITESPACE = ""  # between JSON tokens


def schema_to_regex(schema: str) -> str:
    """The regex for a JSON schema given as a JSON string; ValueError names what is wrong."""
    data = json.loads(schema)
    if not isinstance(data, dict):
        raise ValueError("json_schema must be a JSON object")
    _check_valid(data)
    ranges: list[str] = []
    rewritten = _rewrite(data, "", ranges)
    from outlines_core.json_schema import build_regex_from_schema
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), WHITESPACE)
    except ValueError as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise ValueError(f"json_schema is not supported: {first_line}") from None
    for i, pattern in enumerate(ranges):
        regex = regex.replace(json.dumps(_PLACEHOLDER.format(i)), pattern)
    return regex


def _check_valid(schema: dict) -> None:
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/" + "/".join(map(str, exc.absolute_path))
        raise ValueError(f"json_schema is invalid at {where}: {exc.message}") from None


def _rewrite(schema: Any, path: str, ranges: list[str]) -> Any:
    """A copy of `schema` with integer bounds replaced by placeholders (their regexes go to
    `ranges`); raises on keywords that would not be enforced."""
    if isinstance(schema, bool):
        return schema
    unknown = sorted(set(schema) - ENFORCED - ANNOTATIONS - set(INT_BOUNDS))
    if unknown:
        raise ValueError(f"json_schema keyword {unknown[0]!r} at {path or '/'} is not supported")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise ValueError(f"json_schema at {path or '/'}: 'pattern' cannot be combined with "
                         "'minLength'/'maxLength' (put the length into the pattern)")
    if len(schema.get("allOf", ())) > 1:
        raise ValueError(f"json_schema at {path or '/'}: 'allOf' with more than one schema is "
                         "not supported")
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS:
            value = {name: _rewrite(sub, f"{path}/{key}/{name}", ranges) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS:
            value = [_rewrite(sub, f"{path}/{key}/{i}", ranges) for i, sub in enumerate(value)]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _rewrite(value, f"{path}/{key}", ranges)
        elif key == "items" and isinstance(value, list):
            value = [_rewrite(sub, f"{path}/items/{i}", ranges) for i, sub in enumerate(value)]
        out[key] = value
    if any(key in schema for key in INT_BOUNDS):
        return _bounded_integer(out, path, ranges)
    return out


def _bounded_integer(schema: dict, path: str, ranges: list[str]) -> dict:
    where = path or "/"
    if schema.get("type") != "integer":
        raise ValueError(f"json_schema at {where}: minimum/maximum are supported on "
                         "'type': 'integer' only")
    if "enum" in schema or "const" in schema:
        raise ValueError(f"json_schema at {where}: minimum/maximum cannot be combined with "
                         "enum/const")
    low, high = _bound(schema, "minimum", "exclusiveMinimum", 1), _bound(schema, "maximum", "exclusiveMaximum", -1)
    try:
        pattern = int_range_regex(low, high)
    except ValueError as exc:
        raise ValueError(f"json_schema at {where}: {exc}") from None
    ranges.append(pattern)
    kept = {k: v for k, v in schema.items() if k in ANNOTATIONS}
    return {**kept, "const": _PLACEHOLDER.format(len(ranges) - 1)}


def _bound(schema: dict, inclusive: str, exclusive: str, step: int) -> int | None:
    """The tightest inclusive integer bound; `step` is +1 for a lower bound, -1 for an upper."""
    candidates = []
    if inclusive in schema:
        value = schema[inclusive]
        candidates.append(math.ceil(value) if step > 0 else math.floor(value))
    if exclusive in schema:
        value = schema[exclusive]
        if isinstance(value, bool):
            raise ValueError(f"json_schema: a boolean {exclusive} (draft 4) is not supported; "
                             "give the bound as a number")
        candidates.append(math.floor(value) + 1 if step > 0 else math.ceil(value) - 1)
    if not candidates:
        return None
    return max(candidates) if step > 0 else min(candidates)
