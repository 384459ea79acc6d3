"""Sampling options by name, as programs give them: SamplingParams fields, and SGLang's names.

One table, used by gen, by run / run_batch / a direct call, so every place takes the same names:

    SGLang name         stemma (SamplingParams field)
    max_tokens          max_new_tokens      (gen's name in SGLang; run takes max_new_tokens)
    min_tokens          min_new_tokens
    return_logprob      logprobs
    top_logprobs_num    top_logprobs

SGLang passes None for an option a call does not set, so None is "not given" for these names.
`return_text_in_logprobs` is accepted and changes nothing (stemma's logprobs are numbers, each
output token's id is in `token_ids`). `stop_regex` and `logprob_start_len` have no equivalent: any
value but None is a NotImplementedError that says so.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from stemma.sampling_params import SamplingParams

FIELDS = frozenset(f.name for f in fields(SamplingParams))
ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
           "return_logprob": "logprobs", "top_logprobs_num": "top_logprobs"}
UNSUPPORTED = {
    "stop_regex": "stemma stops on strings (stop) and token ids (stop_token_ids), not on regexes; "
                  "constrain the output with regex= instead",
    "logprob_start_len": "stemma returns the logprobs of generated tokens (return_logprob=True); "
                         "select scores prompt tokens",
}
IGNORED = frozenset({"return_text_in_logprobs"})
NAMES = FIELDS | ALIASES.keys() | UNSUPPORTED.keys() | IGNORED
# The sampling options SGLang's run() and run_batch() take as their own keywords: a program
# parameter of one of these names cannot be passed by keyword there either (stemma.lang.function)
RUN_KEYWORDS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs"})


def is_option(name: str) -> bool:
    """Whether `name` is a sampling option (a field, or an SGLang name for one)."""
    return name in NAMES


def normalize(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The SamplingParams fields `options` set. Unknown names are kept, for SamplingParams to
    name in its error; an option given under two names is a ValueError naming both."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in UNSUPPORTED:
            if value is not None:
                raise NotImplementedError(f"{where}: {name} is not supported: {UNSUPPORTED[name]}")
            continue
        if name in IGNORED:
            continue
        if name in ALIASES:
            if value is None:
                continue
            field = ALIASES[name]
            if field in options:
                raise ValueError(f"{where}: {name} and {field} are the same option (SGLang's name "
                                 f"and stemma's); give one")
            out[field] = bool(value) if name == "return_logprob" else value
        else:
            out[name] = value
    return out
