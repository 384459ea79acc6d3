"""Forced tool calls on `/v1/chat/completions`, as a vLLM server makes them without a tool parser:
`tool_choice` naming a function constrains the reply to that function's parameters (JSON schema),
and `"required"` to a JSON list of `{"name", "parameters"}` calls of the given tools; the reply
comes back as the message's `tool_calls`. `"none"` shows the tools to the chat template only.
`"auto"` (the default when tools are given) needs a parser for the model's own tool-call format,
which stemma does not have: a 400, as from vLLM without one."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from stemma.serve.http.errors import bad_field

FREE_OBJECT = {"type": "object"}
DEFINITIONS = ("$defs", "definitions")  # where JSON schemas keep what "$ref" names


@dataclass(frozen=True)
class ForcedTools:
    """What a request's tool_choice forces: one named function, or any list of the tools' calls."""
    schema: dict[str, Any]      # the JSON schema the reply is constrained to
    name: str | None            # the named function; None: "required"

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI tool_calls of a finished reply; None when it is not whole (cut at
        max_tokens, so the JSON does not parse)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if self.name is not None:
            return [call(self.name, text)]
        try:  # strict JSON out: a number the schema allows may parse to inf (1e999): text then
            return [call(item["name"], json.dumps(item["parameters"], ensure_ascii=False, allow_nan=False))
                    for item in value]
        except (KeyError, TypeError, ValueError):  # the schema makes this a list of calls
            return None

    def finish_reason(self, reason: str | None, calls: list | None) -> str | None:
        """As vLLM: "tool_calls" when "required" made whole calls; a named call ends "stop"."""
        return "tool_calls" if self.name is None and calls and reason == "stop" else reason


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool; a 400 for one that is not a function with a name."""
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise bad_field(f"tools[{i}]", "each tool must be {\"type\": \"function\", \"function\": "
                                           "{\"name\": ..., \"parameters\": {...}}}")
        parameters = function.get("parameters") or FREE_OBJECT
        if not isinstance(parameters, dict):
            raise bad_field(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
        out[function["name"]] = parameters
    return out


def _required(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of a list of calls of `functions`. Each tool's parameters sit inside it, so the
    definitions their "#/$defs/..." references name move to its root (a 400 when two tools define
    one name differently)."""
    shared: dict[str, dict[str, Any]] = {}
    calls = []
    for name, parameters in functions.items():
        for key in DEFINITIONS:
            defined = parameters.get(key)
            for def_name, schema in (defined.items() if isinstance(defined, dict) else ()):
                if shared.setdefault(key, {}).setdefault(def_name, schema) != schema:
                    raise bad_field("tools", f"two tools define {key}/{def_name} differently; with "
                                             "tool_choice \"required\" their definitions are shared")
        inner = {k: v for k, v in parameters.items() if k not in DEFINITIONS}
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": inner},
                      "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **shared}


def forced_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ForcedTools | None:
    """What tool_choice forces (None: nothing, the reply is text); a 400 for what cannot be served."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if choice == "auto":
        raise bad_field("tool_choice", "tool_choice \"auto\" (the default when tools are given) needs a "
                                       "parser for the model's tool-call format, which this server does "
                                       "not have; send \"required\", a named function, or \"none\"")
    if not tools:
        raise bad_field("tool_choice", f"tool_choice {choice!r} needs tools")
    functions = _functions(tools)
    if choice == "required":
        return ForcedTools(_required(functions), None)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise bad_field("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} naming "
                                       f"one of the tools ({', '.join(map(repr, functions))}); got {choice!r}")
    return ForcedTools(functions[name], name)
