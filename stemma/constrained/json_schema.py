"""JSON schema -> the regex outlines-core decodes by, refusing what it would not enforce.

outlines-core turns a schema into a regex, but it silently drops some keywords (integer bounds,
`multipleOf`, `uniqueItems`, a `pattern` beside a length), and, in a subschema, every keyword but
the one it acts on (`oneOf` is taken as `anyOf`): an output that ignores them would not validate.
So a schema is checked in these passes, each error naming the keyword and where it is:

1. it must be a valid schema (`jsonschema`'s metaschema check);
2. every keyword must be one that is enforced, or a pure annotation (title, description, ...);
3. keywords that outlines-core would not enforce together are refused together (_check_together):
   `$ref`, `anyOf`, `oneOf` and `allOf` stand alone, `enum`/`const` beside a `type` that all their
   values have, `format` beside `type` only, a type's keywords only under that type, `required`
   names only properties the schema defines, no item counts beside `prefixItems`, and `oneOf`
   only over branches of different types (so that no value matches two);
4. a string's `pattern` and `format` become regexes a JSON string can hold (json_pattern);
5. integer `minimum`/`maximum`/`exclusive*` are rewritten to a placeholder constant, and the
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
from stemma.constrained.json_pattern import format_pattern, string_pattern

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly"})
ENFORCED = frozenset({"type", "properties", "required", "additionalProperties", "items",
                      "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf", "oneOf",
                      "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern",
                      "format"})
INT_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ALONE = ("$ref", "anyOf", "oneOf", "allOf")  # outlines-core acts on these and drops what is beside
_TYPE_KEYWORDS = {"object": frozenset({"properties", "required", "additionalProperties"}),
                  "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
                  "string": frozenset({"minLength", "maxLength", "pattern", "format"})}
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
    _check_together(schema, path or "/")
    out = {}
    for key, value in schema.items():
        if key == "pattern":
            value = string_pattern(value, path or "/")
        elif key == "format":
            key, value = "pattern", format_pattern(value, path or "/")
        elif key in _SUBSCHEMA_MAPS:
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


def _check_together(schema: dict, where: str) -> None:
    """Refuses keywords that outlines-core would not enforce together (module docstring, 3)."""
    keys = set(schema) - ANNOTATIONS - {"$defs", "definitions"}

    def refuse(why: str):
        raise ValueError(f"json_schema at {where}: {why}")
    for alone in _ALONE:
        if alone in keys and keys != {alone}:
            where_to = "the referenced schema" if alone == "$ref" else f"each {alone!r} branch"
            refuse(f"{alone!r} cannot be combined with {sorted(keys - {alone})[0]!r} (only one of "
                   f"them would be enforced); move the other keywords into {where_to}")
    for listed in ("enum", "const"):
        if listed in keys:
            if keys - {listed, "type"}:
                refuse(f"{listed!r} cannot be combined with {sorted(keys - {listed, 'type'})[0]!r}")
            values = schema[listed] if listed == "enum" else [schema[listed]]
            if "type" in keys:
                from jsonschema.validators import validator_for
                typed = validator_for(schema)({"type": schema["type"]})
                wrong = [v for v in values if not typed.is_valid(v)]
                if wrong:
                    refuse(f"{listed} value {wrong[0]!r} is not of type {schema['type']!r}")
    if "format" in keys and keys - {"format", "type"}:
        refuse(f"'format' cannot be combined with {sorted(keys - {'format', 'type'})[0]!r}")
    kinds = [kind for kind, words in _TYPE_KEYWORDS.items() if keys & words]
    declared = schema.get("type")
    for kind in kinds:
        if declared is not None and declared != kind:
            word = sorted(keys & _TYPE_KEYWORDS[kind])[0]
            refuse(f"{word!r} applies to type {kind!r}, and the type here is {declared!r}")
    if len(kinds) > 1:
        refuse(f"keywords of types {kinds[0]!r} and {kinds[1]!r} together; give one 'type'")
    missing = [name for name in schema.get("required", ()) if name not in schema.get("properties", {})]
    if missing:
        refuse(f"'required' names {missing[0]!r}, which 'properties' does not define")
    if "prefixItems" in keys and keys & {"minItems", "maxItems"}:
        refuse("'minItems'/'maxItems' cannot be combined with 'prefixItems'")
    if "oneOf" in keys:
        types = [branch.get("type") if isinstance(branch, dict) else None for branch in schema["oneOf"]]
        distinct = all(isinstance(t, str) for t in types) and len(set(types)) == len(types)
        if not distinct or {"integer", "number"} <= set(types):
            refuse("'oneOf' is supported only over branches of different types (no value may "
                   "match two of them; 'integer' and 'number' overlap); use 'anyOf'")


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
