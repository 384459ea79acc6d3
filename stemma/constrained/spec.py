"""What a request's constraint is, checked at submission so that it never fails inside the batch.

`check(params)` turns the `regex` / `json_schema` / `grammar` field into a ConstraintSpec:

- a regex is compiled by outlines-core against a 256-token byte vocabulary (milliseconds; the real
  vocabulary's Index is built later, in the background); llguidance's regex parser supplies the
  error message when it has a more precise one;
- a JSON schema is checked and turned into a regex (json_schema), then checked as a regex;
- a grammar is compiled by llguidance's Lark front end, without a tokenizer.

Every error is a ValueError that starts with the field's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from stemma.sampling_params import SamplingParams

CONSTRAINT_FIELDS = ("regex", "json_schema", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    kind: str     # "regex" (outlines-core) or "grammar" (llguidance)
    source: str   # the regex, or the Lark grammar
    field: str    # the SamplingParams field it came from

    def __post_init__(self) -> None:
        if self.kind not in ("regex", "grammar"):
            raise ValueError(f"kind must be regex or grammar, got {self.kind!r}")
        if self.field not in CONSTRAINT_FIELDS:
            raise ValueError(f"field must be one of {', '.join(CONSTRAINT_FIELDS)}, got {self.field!r}")


def check(params: SamplingParams) -> ConstraintSpec | None:
    """The request's constraint, compiled once to prove it is sound; None when it has none.
    Whatever the compilers raise on a value is a ValueError naming the field: a schema nested
    past the recursion limit, or one jsonschema's own check trips over ({"$schema": []} raised
    TypeError), is the request's fault, never the engine's."""
    for field in CONSTRAINT_FIELDS:
        value = getattr(params, field)
        if value is not None:
            try:
                return _compile(field, value)
            except ValueError:
                raise
            except RecursionError:
                raise ValueError(f"{field} is nested too deeply") from None
            except Exception as exc:
                raise ValueError(f"{field} is not supported: {type(exc).__name__}: {exc}") from None
    return None


@lru_cache(maxsize=256)
def _compile(field: str, value: str) -> ConstraintSpec:
    if field == "grammar":
        _check_grammar(value)
        return ConstraintSpec("grammar", value, field)
    if field == "json_schema":
        from stemma.constrained.json_schema import schema_to_regex
        regex = schema_to_regex(value)
    else:
        regex = value
    _check_regex(field, regex)
    return ConstraintSpec("regex", regex, field)


@lru_cache(maxsize=1)
def _byte_vocabulary():
    from outlines_core import Vocabulary
    return Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def _check_regex(field: str, regex: str) -> None:
    from stemma.constrained import end_mark
    if end_mark.marks_cleanly(regex):  # built over bytes (and cached for the Index build)
        return
    from outlines_core import Index
    try:
        Index(regex, _byte_vocabulary())
    except ValueError as exc:
        detail = _llguidance_regex_error(regex) or str(exc).strip().splitlines()[0]
        what = "the regex made from json_schema" if field == "json_schema" else f"regex {regex!r}"
        raise ValueError(f"{field}: {what} cannot be compiled: {detail}") from None


def _llguidance_regex_error(regex: str) -> str | None:
    """The `error: ...` line of llguidance's regex parser, when it rejects the regex too."""
    from llguidance import LLMatcher
    message = LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(regex))
    for line in message.splitlines():
        if line.startswith("error: "):
            return line[len("error: "):]
    return None


def _check_grammar(grammar: str) -> None:
    from llguidance import LLMatcher
    message = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar))
    if message:
        raise ValueError(f"grammar is invalid: {message.strip()}")
