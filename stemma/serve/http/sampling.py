"""An OpenAI request's fields as the one SamplingParams, and its errors under the OpenAI names."""
from __future__ import annotations

from typing import Any

from stemma.sampling_params import SamplingParams
from stemma.serve.http.errors import ApiError, bad_field
from stemma.serve.http.openai_models import SamplingFields

# SamplingParams field -> the request field it comes from, for error messages
OPENAI_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
               "top_logprobs": "logprobs", "json_schema": "response_format", "grammar": "ebnf"}
PASSED = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
          "repetition_penalty", "ignore_eos", "stop_token_ids", "regex", "skip_special_tokens",
          "include_stop_str_in_output", "priority", "ttft_slo_ms", "itl_slo_ms")
# vLLM's constraint fields -> the SamplingParams field each becomes
GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "regex"),
          ("guided_grammar", "grammar"))
REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (vLLM's guided_choice)."""
    return "|".join("".join("\\" + c if c in REGEX_SPECIAL else c for c in choice) for choice in choices)


def _constraint(req: SamplingFields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out["json_schema"] = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_field("response_format.json_schema",
                            "response_format of type json_schema needs json_schema.schema")
        out["json_schema"] = fmt.json_schema.schema_
    if req.json_schema is not None:
        out["json_schema"] = req.json_schema
    grammar = req.ebnf if req.ebnf is not None else req.grammar
    if grammar is not None:
        out["grammar"] = grammar
    for name, field in GUIDED:
        value = getattr(req, name)
        if value is None:
            continue
        if out or req.regex is not None:
            raise bad_field(name, f"{name} cannot be combined with another constraint "
                                  "(response_format, json_schema, regex, grammar or guided_*)")
        out[field] = choice_regex(value) if name == "guided_choice" else value
    return out


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value  # ids past the vocabulary or below 0 are SamplingParams' to refuse
        except ValueError:  # "1.5", "--5", "²", or past int()'s digit limit
            raise bad_field("logit_bias", f"logit_bias keys must be token ids, got {key[:40]!r}") from None
    return out


def constraint_field(req: SamplingFields) -> str | None:
    """The request field that carries its constraint (what a refusal of it names), if any."""
    for name in ("regex", "json_schema", "ebnf", "grammar", *(name for name, _ in GUIDED)):
        if getattr(req, name, None) is not None:
            return name
    return "response_format" if req.response_format is not None and req.response_format.type != "text" else None


def has_constraint(req: SamplingFields) -> bool:
    """Whether the request constrains its output (response_format, regex, guided_*, ...)."""
    return req.regex is not None or bool(_constraint(req))


def params_of(req: SamplingFields, max_new_tokens: int, **more: Any) -> SamplingParams:
    """The request's SamplingParams; a bad value is a 400 naming the request's field."""
    fields: dict[str, Any] = {name: getattr(req, name) for name in PASSED
                              if getattr(req, name) is not None}
    fields.update(n=req.n, stop=req.stop, max_new_tokens=max_new_tokens,
                  logit_bias=_logit_bias(req.logit_bias), **_constraint(req))
    if req.min_tokens is not None:
        fields["min_new_tokens"] = req.min_tokens
    if req.seed is not None:
        fields["seed"] = req.seed % 2**63  # SamplingParams' seeds are in [0, 2**63)
    fields.update(more)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        raise bad_field(OPENAI_NAME.get(name, name), message) from None


def native_params(values: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams.from_dict(values)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        raise bad_field(f"sampling_params.{message.split(' ', 1)[0]}", message) from None


def check_model(name: str, served: tuple[str, ...]) -> None:
    if name not in served:
        raise ApiError(404, f"the model {name!r} does not exist here; this server serves "
                       f"{served[0]!r}", param="model", code="model_not_found")
