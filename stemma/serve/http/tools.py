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
        except ValueError:
            return None
        if self.name is not None:
            return [call(self.name, text)]
        try:
            return [call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
        except (KeyError, TypeError):  # the schema makes this a list of calls; anything else is text
            return None


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
        return ForcedTools({"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
             "required": ["name", "parameters"]} for name, parameters in functions.items()]}}, None)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise bad_field("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} naming "
                                       f"one of the tools ({', '.join(map(repr, functions))}); got {choice!r}")
    return ForcedTools(functions[name], name)
