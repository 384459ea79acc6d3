"""How one request samples: the single place where sampling options are named and checked.

Every layer (frontend, wire protocol, engine, sampler) passes a whole `SamplingParams`, never its
fields one by one. It is torch-free so that `import stemma` stays light. The fields are checked
once, in `__post_init__`; every error is a ValueError whose message starts with the field's name.
`regex` / `json_schema` / `grammar` constrain the output (at most one per request). Here they are
only type-checked; stemma.constrained.spec compiles them when the engine takes the request.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from stemma.field_doc import doc

# a temperature below this samples greedily (as vLLM and SGLang take it): dividing logits by less
# can overflow float32 to +-inf, and a row whose allowed tokens all became -inf would "sample" a
# token its constraint forbids
GREEDY_BELOW = 1e-5
INT_LIMIT = 2**63  # every int option and token id is below it: the wire's ints (msgpack) and
                   # int64 tensors (seeds) hold 64 bits



class ParamError(ValueError):
    """A request refused for one of its fields: `param` is a SamplingParams field, or "prompt".
    The engine's reply carries it (ErrorMsg.param), so an HTTP error names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value < INT_LIMIT


def _check_int(name: str, value: Any, low: int) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if value >= INT_LIMIT:
        raise ValueError(f"{name} must be < 2**63, got an int of {len(str(value))} digits")


def _check_real(name: str, value: Any, low: float, high: float = math.inf,
                low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{name} must be finite, got an int of {len(str(value))} digits") from None
    if not finite:
        raise ValueError(f"{name} must be finite, got {value}")
    if (value <= low) if low_open else (value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _normalize_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must hold non-empty strings, got {item!r}")
    return tuple(items)


def _normalize_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {value!r}")
    for item in value:
        if not _is_token_id(item):
            raise ValueError(f"{name} must hold ints >= 0 and < 2**63, got {item!r}")
    return tuple(value)


def _normalize_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} or (token id, bias) pairs as pairs sorted by id; biases in [-100, 100]."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)) and not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}")
    out = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got {item!r}")
        token, bias = item
        if not _is_token_id(token):
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0 and < 2**63), got {token!r}")
        _check_real("logit_bias", bias, -100.0, 100.0)
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _check_text(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")


def _normalize_schema(value: Any) -> str | None:
    """A JSON schema (dict or JSON text) as compact JSON text; key order is kept (it orders the
    generated properties)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON object (a dict or its JSON text), got {value!r}")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema must hold JSON values only: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Each field's help text is its `stemma ... --help` description (see stemma.field_doc)."""
    max_new_tokens: int = doc(128, "most tokens to generate")
    min_new_tokens: int = doc(0, "EOS and stop_token_ids are banned, and stop strings not matched, "
                                 "until this many tokens")
    temperature: float = doc(1.0, f"0 (or anything below {GREEDY_BELOW}) means greedy")
    top_p: float = doc(1.0, "nucleus sampling: keep the most likely tokens up to this "
                            "probability mass; in (0, 1], 1 is off")
    top_k: int = doc(-1, "keep only the k most likely tokens; -1 is off")
    min_p: float = doc(0.0, "drop tokens less likely than min_p times the most likely one; in "
                            "[0, 1], 0 is off")
    repetition_penalty: float = doc(1.0, "HF semantics, over prompt + output tokens; 1 is off")
    frequency_penalty: float = doc(0.0, "OpenAI semantics, over output tokens; in [-2, 2]")
    presence_penalty: float = doc(0.0, "OpenAI semantics, over output tokens; in [-2, 2]")
    stop: tuple[str, ...] | str | list[str] | None = doc(
        (), "stop strings, left out of the text (see include_stop_str_in_output); normalized to a "
            "tuple of strings")
    stop_token_ids: tuple[int, ...] = doc((), "token ids that end the output")
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = doc(
        (), "token id -> bias added to its logit (OpenAI semantics, in [-100, 100]); normalized "
            "to sorted (id, bias) pairs")
    ignore_eos: bool = doc(False, "keep generating past EOS")
    seed: int | None = doc(None, "same seed -> same tokens, whatever the batch; not given: unseeded")
    n: int = doc(1, "how many outputs to sample for the prompt")
    logprobs: bool = doc(False, "return the chosen token's logprob")
    top_logprobs: int = doc(0, "return this many most likely tokens per position; 0 is off")
    logprob_start: int | None = doc(None, "absolute prompt position from which prompt logprobs "
                                          "are returned; not given: none are")
    skip_special_tokens: bool = doc(True, "leave special tokens (BOS, EOS, ...) out of the text")
    include_stop_str_in_output: bool = doc(False, "keep what ended the output (its stop string, stop "
                                                  "token or EOS) at the end of its text (vLLM's "
                                                  "field; SGLang's no_stop_trim)")
    regex: str | None = doc(None, "the output must fullmatch this regex")
    json_schema: str | dict | None = doc(None, "the output must be JSON valid under this schema "
                                               "(a dict or its JSON text); normalized to compact "
                                               "JSON text")
    grammar: str | None = doc(None, "the output must parse under this Lark-syntax grammar")
    # how the request is scheduled (stemma.engine.slo), not how it samples
    priority: int = doc(0, "scheduling priority, higher first; a waiting request may preempt "
                           "running ones at least the engine's priority_preemption_gap lower")
    ttft_slo_ms: float | None = doc(None, "time-to-first-token target in ms; not given: the "
                                          "engine's default_ttft_slo_ms")
    itl_slo_ms: float | None = doc(None, "inter-token latency target in ms; not given: the "
                                         "engine's default_itl_slo_ms")

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_new_tokens}")
        _check_real("temperature", self.temperature, 0.0)
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1, got 0")
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("repetition_penalty", self.repetition_penalty, 0.0, low_open=True)
        _check_real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids",
                           _normalize_token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        _check_bool("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        _check_int("n", self.n, 1)
        _check_bool("logprobs", self.logprobs)
        _check_int("top_logprobs", self.top_logprobs, 0)
        if self.logprob_start is not None:
            _check_int("logprob_start", self.logprob_start, 0)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_text("regex", self.regex)
        object.__setattr__(self, "json_schema", _normalize_schema(self.json_schema))
        _check_text("grammar", self.grammar)
        _check_int("priority", self.priority, -2**31)
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            if getattr(self, name) is not None:
                _check_real(name, getattr(self, name), 0.0, low_open=True)
        given = [name for name in ("regex", "json_schema", "grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]} cannot be combined with {given[0]}: give at most one of "
                             "regex, json_schema and grammar")

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax: temperature below GREEDY_BELOW, or top_k 1."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def is_constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.grammar is not None

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains the output (at most one does), or None."""
        return "regex" if self.regex is not None else "json_schema" if self.json_schema is not None \
            else "grammar" if self.grammar is not None else None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def to_dict(self, omit_defaults: bool = False) -> dict[str, Any]:
        """Plain types only (tuples become lists). `omit_defaults`: only the fields that differ
        from their defaults (from_dict restores the rest), as the wire carries them: a side that
        predates a field still reads every request that leaves it at its default."""
        out = asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if omit_defaults:
            out = {f.name: out[f.name] for f in fields(self) if getattr(self, f.name) != f.default}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        """The inverse of to_dict; missing fields take their defaults, unknown ones are an error."""
        if not isinstance(data, Mapping):
            raise ValueError(f"SamplingParams.from_dict needs a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown SamplingParams fields: {', '.join(map(str, unknown))}")
        return cls(**data)

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed, validated like a new one."""
        return SamplingParams.from_dict({**self.to_dict(), **changes})


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
