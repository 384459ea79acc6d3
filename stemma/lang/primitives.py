"""What programs append: gen, select and the chat roles. Each returns an IR node, checked at once.

gen takes SGLang's signature (name, max_tokens, min_tokens, ..., dtype, choices, regex,
json_schema) and stemma's own SamplingParams names; see options.py for how the names map.
"""
from __future__ import annotations

from typing import Any, Sequence

from stemma.lang.ir import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, Concat, Content, Gen,
                            Node, RoleBegin, RoleEnd, Select, as_node)
from stemma.lang.options import normalize
from stemma.lang.scoring import DEFAULT_METHOD, METHODS
from stemma.sampling_params import SamplingParams

# Fields that are the program's business, not a gen's: one continuation per gen (fork for more),
# and prompt logprobs are what select uses.
_NOT_FOR_GEN = ("n", "logprob_start")

# dtype -> the regex its value must fullmatch (SGLang's dtype names: the type, or its name)
DTYPES = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}
_DTYPE_NAMES = {t.__name__: t for t in DTYPES}

# select's methods under SGLang's names (sglang.token_length_normalized, ...)
token_length_normalized = "token_length_normalized"
greedy_token_selection = "greedy_token"
unconditional_likelihood_normalized = "unconditional_likelihood_normalized"
_METHOD_ALIASES = {"greedy_token_selection": "greedy_token"}


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None, stop_regex: Any = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None,
        return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: type | str | None = None, choices: Sequence[str] | None = None,
        choices_method: str | None = None, regex: str | None = None,
        json_schema: str | dict | None = None, **params: Any) -> Gen | Select:
    """Generates into variable `name`; the options override the run's defaults for this call only.

    The named arguments are SGLang's, None meaning "not set"; `params` takes any other
    SamplingParams field by stemma's name (max_new_tokens, seed, repetition_penalty, grammar, ...).
    `dtype` (int, float, bool, str, or its name) constrains the value by a regex (ir.REGEX_*);
    `choices` makes this a select (`choices_method` its method), and the sampling options are
    then unused, as in SGLang."""
    _check_name(name, "gen")
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    if choices_method is not None:
        raise ValueError(f"gen {name!r}: choices_method needs choices")
    if n is not None and n != 1:
        params["n"] = n  # refused below
    named = dict(stop=stop, stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p,
                 top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                 presence_penalty=presence_penalty, ignore_eos=ignore_eos, regex=regex,
                 json_schema=json_schema)
    for field, value in named.items():
        if value is not None:
            params[field] = value
    if dtype is not None:
        if regex is not None or json_schema is not None or "grammar" in params:
            raise ValueError(f"gen {name!r}: dtype constrains the value by a regex, so it cannot be "
                             f"combined with regex, json_schema or grammar")
        params["regex"] = _dtype_regex(dtype, name)
    sglang = dict(max_tokens=max_tokens, min_tokens=min_tokens, stop_regex=stop_regex,
                  return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                  top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs)
    params = normalize({**params, **sglang}, f"gen {name!r}")
    for field in _NOT_FOR_GEN:
        if field in params:
            raise ValueError(f"gen does not take {field!r}" +
                             (": fork the state for several continuations" if field == "n" else ""))
    checked = SamplingParams.from_dict(params)  # checks names and values where the program says them
    return Gen(name, tuple(sorted((k, getattr(checked, k)) for k in params)))  # normalized values


def gen_int(name: str | None = None, max_tokens: int | None = None, **options: Any) -> Gen:
    """gen constrained to an integer (ir.REGEX_INT); `int(state[name])` reads it."""
    return gen(name, max_tokens, dtype=int, **options)


def gen_string(name: str | None = None, max_tokens: int | None = None, **options: Any) -> Gen:
    """gen constrained to a double-quoted string without escapes (ir.REGEX_STR)."""
    return gen(name, max_tokens, dtype=str, **options)


def _dtype_regex(dtype: type | str, name: str | None) -> str:
    key = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if key not in DTYPES:
        raise ValueError(f"gen {name!r}: dtype must be int, float, bool or str (or its name), "
                         f"got {dtype!r}")
    return DTYPES[key]


def select(name: str | None = None, choices: Sequence[str] | None = None,
           temperature: float | None = 0.0, choices_method: str | None = None, *,
           method: str | None = None) -> Select:
    """Picks one of `choices` by its logprobs given the program so far, and appends it.
    `method` (SGLang: `choices_method`) is one of scoring.METHODS, or SGLang's
    greedy_token_selection. Choices are scored, not sampled: `temperature` must be 0 (or None)."""
    _check_name(name, "select")
    if choices_method is not None and method is not None:
        raise ValueError(f"select {name!r}: method and choices_method are the same option; give one")
    method = choices_method if choices_method is not None else (method or DEFAULT_METHOD)
    method = _METHOD_ALIASES.get(method, method)
    if temperature not in (None, 0, 0.0):
        raise ValueError(f"select {name!r}: choices are scored by their logprobs, not sampled; "
                         f"temperature must be 0, got {temperature!r}")
    if choices is None:
        raise ValueError(f"select {name!r}: choices must be a list of strings")
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ValueError(f"select {name!r}: choices must be a list of strings, got {choices!r}")
    if not choices:
        raise ValueError(f"select {name!r}: choices must not be empty")
    for choice in choices:
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"select {name!r}: every choice must be a non-empty string, got {choice!r}")
    if method not in METHODS:
        raise ValueError(f"select {name!r}: method must be one of {', '.join(METHODS)}, got {method!r}")
    return Select(name, tuple(choices), method)


def _check_name(name: str | None, what: str) -> None:
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        raise ValueError(f"{what}: a variable name must be an identifier, got {name!r}")


def _role(role: str, content: tuple[Content | None, ...]) -> Node:
    parts = (as_node(c) for c in content if c is not None)  # SGLang's user(None): an empty turn
    return Concat((RoleBegin(role), *parts, RoleEnd(role)))


def system(*content: Content) -> Node:
    """A system turn holding `content` (text, gen, select, ...); with none, an empty turn."""
    return _role("system", content)


def user(*content: Content) -> Node:
    return _role("user", content)


def assistant(*content: Content) -> Node:
    return _role("assistant", content)


def system_begin() -> Node:
    return RoleBegin("system")


def system_end() -> Node:
    return RoleEnd("system")


def user_begin() -> Node:
    return RoleBegin("user")


def user_end() -> Node:
    return RoleEnd("user")


def assistant_begin() -> Node:
    return RoleBegin("assistant")


def assistant_end() -> Node:
    return RoleEnd("assistant")


# ---- what does not apply to a text model ----
def image(*args: Any, **kwargs: Any) -> Node:
    """SGLang's sgl.image: not available, stemma serves text models only."""
    raise NotImplementedError("sgl.image / stemma.image is not supported: stemma runs text-only "
                              "models (no vision encoder), so a program cannot append an image")


def video(*args: Any, **kwargs: Any) -> Node:
    """SGLang's sgl.video: not available, stemma serves text models only."""
    raise NotImplementedError("sgl.video / stemma.video is not supported: stemma runs text-only "
                              "models (no vision encoder), so a program cannot append a video")
