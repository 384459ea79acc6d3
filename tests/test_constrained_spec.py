"""Constraint specs at submission: SamplingParams fields, integer ranges, JSON schema -> regex, and
the errors for bad regexes, schemas and grammars (each naming the field and the problem)."""
import json
import re

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from stemma import SamplingParams
from stemma.constrained.int_range import int_range_regex
from stemma.constrained.json_schema import schema_to_regex
from stemma.constrained.spec import ConstraintSpec, check

# ---------------------------------------------------------------- SamplingParams fields


def test_json_schema_is_normalized_to_compact_text_keeping_key_order():
    p = SamplingParams(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    assert p.json_schema == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert SamplingParams(json_schema=' {"type": "integer"} ').json_schema == '{"type":"integer"}'
    assert SamplingParams.from_dict(p.to_dict()) == p
    hash(p)


@pytest.mark.parametrize("a,b", [("regex", "grammar"), ("regex", "json_schema"),
                                 ("json_schema", "grammar")])
def test_at_most_one_constraint(a, b):
    values = {"regex": "a", "grammar": "start: \"a\"", "json_schema": {"type": "integer"}}
    with pytest.raises(ValueError, match=rf"^{b} cannot be combined with {a}"):
        SamplingParams(**{a: values[a], b: values[b]})


# ---------------------------------------------------------------- integer ranges

bound = st.none() | st.integers(-10**5, 10**5)


@settings(max_examples=150, deadline=None)
@given(bound, bound, st.lists(st.integers(-2 * 10**5, 2 * 10**5), min_size=20, max_size=40))
def test_int_range_regex_matches_exactly_the_range(low, high, probes):
    if low is not None and high is not None and low > high:
        low, high = high, low
    pattern = re.compile(int_range_regex(low, high))
    edges = [v + d for v in (low, high) if v is not None for d in (-1, 0, 1)]
    for n in probes + edges + [0, -1, 1]:
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, (low, high, n)
    for junk in ("-0", "00", "01", "-01", "+1", ""):
        assert not pattern.fullmatch(junk)


def test_int_range_rejects_an_empty_range():
    with pytest.raises(ValueError, match="minimum 5 > maximum 2"):
        int_range_regex(5, 2)


# ---------------------------------------------------------------- JSON schema -> regex

SCHEMA = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 65, "title": "Age"},
    "level": {"type": "integer", "exclusiveMinimum": -3.5, "maximum": 2},
    "name": {"type": "string", "minLength": 2, "maxLength": 5},
    "kind": {"enum": ["cat", "dog"]},
    "dims": {"type": "array", "items": {"$ref": "#/$defs/small"}, "minItems": 1, "maxItems": 3}},
    "required": ["age", "level", "name", "kind", "dims"],
    "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_schema_regex_enforces_integer_bounds_and_lengths():
    pattern = re.compile(schema_to_regex(json.dumps(SCHEMA)))
    good = {"age": 18, "level": -3, "name": "ab", "kind": "dog", "dims": [0, 9, 5]}
    assert pattern.fullmatch(json.dumps(good, separators=(",", ":")))  # compact JSON
    assert not pattern.fullmatch(json.dumps(good))
    jsonschema.validate(good, SCHEMA)
    for change in ({"age": 17}, {"age": 65}, {"level": -4}, {"level": 3}, {"name": "a"},
                   {"name": "abcdef"}, {"kind": "cow"}, {"dims": []}, {"dims": [10]},
                   {"dims": [1, 2, 3, 4]}):
        bad = json.dumps({**good, **change}, separators=(",", ":"))
        assert not pattern.fullmatch(bad), change
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, **change}, SCHEMA)


@pytest.mark.parametrize("schema,message", [
    ({"type": "strnig"}, r"json_schema is invalid at /type"),
    ({"properties": {"a": {"maxLength": "x"}}}, r"invalid at /properties/a/maxLength: 'x' is not of type 'integer'"),
    ({"type": "integer", "multipleOf": 3}, r"keyword 'multipleOf' at / is not supported"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     r"'uniqueItems' at /properties/a is not supported"),
    ({"type": "number", "minimum": 1}, r"supported on 'type': 'integer' only"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, r"empty integer range"),
    ({"type": "string", "pattern": "a+", "maxLength": 3}, r"'pattern' cannot be combined"),
    ({"type": "string", "format": "ipv4"}, r"format 'ipv4' is not supported"),
    ({"$ref": "#/nope"}, r"not supported: Invalid reference path"),
    # keywords outlines-core would drop beside another: each output broke the schema
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, r"'oneOf' is supported only over branches"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]},
     r"'allOf' cannot be combined with 'properties'"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
     r"'\$ref' cannot be combined with 'maxLength'"),
    ({"type": "string", "anyOf": [{"maxLength": 2}, {"type": "integer"}]}, r"'anyOf' cannot be combined with 'type'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zzz"]},
     r"'required' names 'zzz'"),
    ({"type": "integer", "enum": [1, "2", 3.5]}, r"enum value '2' is not of type 'integer'"),
    ({"enum": ["abcdef", "x"], "maxLength": 2}, r"'enum' cannot be combined with 'maxLength'"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "maxItems": 1}, r"cannot be combined with 'prefixItems'"),
    ({"type": "string", "properties": {"a": {"type": "integer"}}}, r"'properties' applies to type 'object'"),
    ({"type": "string", "format": "date", "maxLength": 10}, r"'format' cannot be combined with 'maxLength'"),
    ({"type": "string", "format": "email"}, r"format 'email' is not supported"),
    # a string pattern that could write what a JSON string cannot hold raw
    ({"type": "string", "pattern": "^.{3}$"}, r"can match '\"', a backslash or a control character"),
    ({"type": "string", "pattern": "[^a]+"}, r"can match"),
    ({"type": "string", "pattern": "a\\Sb"}, r"can match"),
    # what outlines-core's (Rust) syntax reads in a class and Python's re does not
    ({"type": "string", "pattern": "[[:print:]]+"}, r"nested class or a set operation"),
    ({"type": "string", "pattern": "[a[^b]]"}, r"nested class or a set operation"),
    ({"type": "string", "pattern": "[a-z&&[^aeiou]]"}, r"nested class or a set operation"),
    # an anchor between the quotes could never be met: only a leading ^ and a trailing $ go
    ({"type": "string", "pattern": "a^b"}, r"'pattern' 'a\^b' has an anchor or a word boundary"),
    ({"type": "string", "pattern": "^a|b$"}, r"has an anchor"),
    ({"type": "string", "pattern": "\\bab"}, r"has an anchor"),
])
@pytest.mark.filterwarnings("ignore::FutureWarning")  # re on the Rust-syntax patterns, in jsonschema
def test_bad_or_unsupported_schema_is_named(schema, message):
    with pytest.raises(ValueError, match=r"^json_schema") as err:
        check(SamplingParams(json_schema=schema))
    assert re.search(message, str(err.value)), str(err.value)


@pytest.mark.parametrize("schema,good,bad", [
    ({"type": "string", "pattern": "^\\d{3}-\\w+$"}, ["123-ab_9"], ["\u0661\u0662\u0663-ab", "123-\u00e9"]),
    ({"type": "string", "pattern": "a\\sb"}, ["a b", "a\u00a0b"], ["a\tb", "a\nb"]),
    ({"type": "string", "pattern": "[a-z]+$"}, ["ab"], ["ab$", ""]),  # the $ went in as written
    ({"type": "string", "pattern": "^[a-z]+"}, ["ab"], ["^ab"]),
    ({"type": "string", "format": "date"}, ["2024-02-29"], ["\u0662024-02-29", "2024-13-01"]),
    ({"type": "string", "format": "time"}, ["23:59:59Z", "01:02:03.25+05:30"], ["01:02:03\\75Z", "01:02:03"]),
    ({"type": "string", "format": "date-time"}, ["2024-01-02T03:04:05Z"], ["2024-01-02 03:04:05Z"]),
    ({"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "string"}]}},
      "required": ["v"]}, [{"v": 3}, {"v": "x"}], [{"v": 2.5}]),
    ({"type": "integer", "enum": [1, 3]}, [1, 3], [2]),
])
def test_patterns_and_formats_are_ascii_and_json_safe(schema, good, bad):
    """JSON Schema's \\d and \\w are ASCII (outlines-core's matched any Unicode digit or letter);
    \\s is a blank a JSON string holds raw; formats as RFC 3339 writes them (outlines-core's
    `time` took a literal backslash for its fraction's dot); what stays is what validates."""
    pattern = re.compile(schema_to_regex(json.dumps(schema)))
    def text(value):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for value in good:
        assert pattern.fullmatch(text(value)), value
        json.loads(text(value))
    for value in bad:
        assert not pattern.fullmatch(text(value)), value


# ---------------------------------------------------------------- regexes and grammars

ARITHMETIC = '''start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
'''


def test_specs_of_each_field():
    assert check(SamplingParams()) is None
    assert check(SamplingParams(regex=r"\d+")) == ConstraintSpec("regex", r"\d+", "regex")
    spec = check(SamplingParams(json_schema={"type": "boolean"}))
    assert (spec.kind, spec.source, spec.field) == ("regex", "(true|false)", "json_schema")
    assert check(SamplingParams(grammar=ARITHMETIC)) == ConstraintSpec("grammar", ARITHMETIC, "grammar")


@pytest.mark.parametrize("regex,message", [
    ("[a-z", "unclosed character class"),
    ("(?=a)b", "look-around"),
    (r"(a)\1", "backreferences are not supported"),
    ("a{5,2}", "invalid repetition count"),
])
def test_bad_regex_is_named(regex, message):
    with pytest.raises(ValueError, match=r"^regex: regex .* cannot be compiled") as err:
        check(SamplingParams(regex=regex))
    assert message in str(err.value)


@pytest.mark.parametrize("grammar,message", [
    ("start: foo", 'unknown name: "foo"'),
    ('stat: "a"', "no start rule"),
    ('start: "a" (', "grammar is invalid"),
])
def test_bad_grammar_is_named(grammar, message):
    with pytest.raises(ValueError, match="^grammar is invalid") as err:
        check(SamplingParams(grammar=grammar))
    assert message in str(err.value)
