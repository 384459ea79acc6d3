"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template, or, for a
model without one, the frontend's documented plain fallback (stemma.lang.chat_template), whose
turns end at the next `User:` / `System:` line; then as completions, with chat's shapes.

Message content is a string or a list of text parts (joined by newlines, as vLLM joins them). `developer` is taken as `system`.
Tools and forced tool calls: stemma.serve.http.tools.
"""
from __future__ import annotations

import functools
import json
from typing import Any, AsyncIterator

from fastapi import Request

from stemma import protocol as P
from stemma.lang.chat_template import PLAIN, ChatTemplate, for_codec
from stemma.lang.codec import HFCodec
from stemma.serve.http import generation as G
from stemma.serve.http.errors import ApiError, bad_field
from stemma.serve.http.openai_models import ChatCompletionRequest, ChatMessage
from stemma.serve.http.sampling import check_model, constraint_field, has_constraint, params_of
from stemma.serve.http.state import HttpState
from stemma.serve.http.tools import ForcedTools, forced_tools


def _content(msg: ChatMessage) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    return "\n".join(part.text for part in msg.content)  # as vLLM joins text parts


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: with an assistant turn's tool calls (their
    arguments as objects, as vLLM hands them to templates) and a tool turn's call id."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m)}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


@functools.lru_cache(maxsize=4)
def _template(tokenizer: Any) -> ChatTemplate:
    return for_codec(HFCodec(tokenizer))


def render(state: HttpState, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
           continue_final: bool = False, tools: list[dict] | None = None) -> tuple[list[int], ChatTemplate]:
    """The prompt's token ids, and the template (its stops end the assistant turn)."""
    tok = state.tokenizer
    if tok is None:
        raise bad_field("messages", "this model has no tokenizer, so it cannot chat")
    template = _template(tok)
    if template is PLAIN:
        _check_plain(messages)
        text = "".join(PLAIN.prefix(m["role"]) + m["content"] + PLAIN.suffix(m["role"]) for m in messages)
        if continue_final and messages and messages[-1]["role"] == "assistant":
            text = text[: len(text) - len(PLAIN.suffix("assistant"))]
        elif add_generation_prompt:
            text += PLAIN.prefix("assistant")
        return list(tok(text).input_ids), template
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt and not continue_final,
                                       continue_final_message=continue_final)
    except Exception as exc:  # jinja templates raise their own errors for what they refuse
        raise bad_field("messages", f"the chat template refused these messages: {exc}") from None
    bos = getattr(tok, "bos_token", None)
    ids = tok(text, add_special_tokens=not (bos and text.startswith(bos))).input_ids
    return list(ids), template


def _check_plain(messages: list[dict[str, Any]]) -> None:
    """The plain fallback has system, user and assistant turns only: a turn it cannot render is
    refused, never dropped from the prompt."""
    for i, m in enumerate(messages):
        if m["role"] not in PLAIN.roles:
            raise bad_field(f"messages.{i}.role", f"this model has no chat template, and the plain "
                            f"fallback renders system, user and assistant turns only, not {m['role']!r}")
        if m.get("tool_calls"):
            raise bad_field(f"messages.{i}.tool_calls", "this model has no chat template, and the plain "
                            "fallback cannot render an assistant turn's tool calls")


def stops_of(req: ChatCompletionRequest, template: ChatTemplate) -> tuple[list[str], list[int]]:
    """The request's stop strings and stop token ids, then the template's, which end the
    assistant turn, unless it asks to ignore EOS (as vLLM's benchmarks do): it then runs to its
    max_tokens past the turn's end too."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_ids = list(req.stop_token_ids or [])
    if not req.ignore_eos:
        stops += [s for s in template.stop if s not in stops]
        stop_ids += [t for t in template.stop_ids if t not in stop_ids]
    return stops, stop_ids


def _start(state: HttpState, req: ChatCompletionRequest, ids: list[int], template: ChatTemplate,
           forced: ForcedTools | None) -> G.Run:
    if not ids:
        raise bad_field("messages", "the messages render to an empty prompt (no tokens)")
    if req.top_logprobs and not req.logprobs:
        raise bad_field("top_logprobs", "top_logprobs needs logprobs: true")
    prompts = [G.Prompt(ids)]
    field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    extra: dict[str, Any] = {}
    if req.logprobs:
        extra.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    extra["stop"], extra["stop_token_ids"] = stops_of(req, template)
    if forced is not None:
        if has_constraint(req):
            raise bad_field("tool_choice", "a forced tool call constrains the reply to the tool's "
                                           "parameters: it takes no response_format, regex or guided_* too")
        extra["json_schema"] = forced.schema
    params = params_of(req, G.max_tokens_for(state, prompts, requested, field_name), **extra)
    return G.start(state, prompts, params, req.stream, call=req.program_call,
                   constraint=constraint_field(req) if forced is None else "tool_choice",
                   prompt_field="messages")


def _logprobs(state: HttpState, ids: list[int], logprobs, tops) -> dict:
    def entry(token: int, lp: float) -> dict:
        # `token` decoded alone (U+FFFD for a piece of a character, as vLLM gives it); `bytes`
        # the token's own, so that a character split over tokens joins back up from them
        text = G.token_text(state.tokenizer, token)
        raw = state.token_bytes(token) if state.token_bytes is not None else text.encode()
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    content = []
    for i, token in enumerate(ids):
        item = entry(token, logprobs[i] if logprobs is not None else 0.0)
        item["top_logprobs"] = [entry(t, lp) for t, lp in tops[i]] if tops is not None else []
        content.append(item)
    return {"content": content}


def _base(state: HttpState, run: G.Run, kind: str) -> dict:
    return {"id": f"chatcmpl-{run.id}", "object": kind, "created": run.created,
            "model": state.model_id}


async def create(state: HttpState, req: ChatCompletionRequest, request: Request):
    check_model(req.model, state.model_names())
    G.check_stream_options(req)
    forced = forced_tools(req.tools, req.tool_choice)
    ids, template = await G.off_loop(render, state, as_dicts(req.messages), req.add_generation_prompt,
                                     req.continue_final_message, req.tools)
    run = _start(state, req, ids, template, forced)
    want_logprobs = req.logprobs

    def body(outs: list[P.Finished]) -> dict:
        choices = []
        for o in outs:
            message = _message(o.text, forced)
            choices.append({"index": run.choice(o), "message": message,
                            "logprobs": _logprobs(state, o.token_ids, o.logprobs, o.top_logprobs)
                            if want_logprobs else None,
                            "finish_reason": _finish_reason(o.finish_reason, message, forced),
                            "stop_reason": G.stop_reason(o)})
        return {**_base(state, run, "chat.completion"), "choices": choices, "usage": G.usage(run, outs)}

    return await G.respond(request, run, lambda: _stream(state, req, run, forced), body)


def _message(text: str, forced: ForcedTools | None) -> dict[str, Any]:
    """The assistant message of a reply: its tool calls when a tool call was forced and the reply
    is whole, else its text."""
    calls = forced.calls(text) if forced is not None else None
    if calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _finish_reason(reason: str | None, message: dict[str, Any], forced: ForcedTools | None) -> str | None:
    if forced is not None:
        reason = forced.finish_reason(reason, message.get("tool_calls"))
    return G.finish_reason(reason)


async def _stream(state: HttpState, req: ChatCompletionRequest, run: G.Run,
                  forced: ForcedTools | None) -> AsyncIterator[str]:
    """Content deltas as they come; a forced tool call's reply is held until it is whole (its
    calls parsed) and sent as one `tool_calls` delta."""
    usage = G.StreamUsage(run, req.stream_options)
    want_logprobs = req.logprobs
    base = _base(state, run, "chat.completion.chunk")

    def chunk(index: int, delta: dict, logprobs=None, reason=None, stop_reason=None) -> str:
        return G.sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": reason, "stop_reason": stop_reason}],
                      **usage.field(index)})

    outs: list[P.Finished | None] = [None] * run.choices
    held = [("", []) for _ in range(run.choices)]  # a forced tool call's text and logprobs so far
    with run.peer:
        try:
            for i in range(run.choices):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for msg in G.replies(run):
                index = run.choice(msg)
                usage.count(msg, index)
                if isinstance(msg, P.TokenChunk):
                    if not msg.text and not msg.token_ids:
                        continue
                    logprobs = None
                    if want_logprobs and msg.token_ids:
                        logprobs = _logprobs(state, msg.token_ids, msg.logprobs, msg.top_logprobs)
                    if forced is not None:
                        text, held_logprobs = held[index]
                        held[index] = (text + msg.text, held_logprobs + (logprobs or {}).get("content", []))
                        continue
                    yield chunk(index, {"content": msg.text}, logprobs)
                else:
                    outs[index] = msg
                    message: dict[str, Any] = {}
                    if forced is not None:
                        text, held_logprobs = held[index]
                        message = _message(text, forced)
                        delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
                                 if "tool_calls" in message else {"content": text})
                        yield chunk(index, delta, {"content": held_logprobs} if want_logprobs else None)
                    yield chunk(index, {}, None, _finish_reason(msg.finish_reason, message, forced),
                                G.stop_reason(msg))
            if usage.final:
                yield G.sse({**base, "choices": [], "usage": G.usage(run, outs)})
        except ApiError as exc:
            yield G.sse_error(exc)
    yield G.DONE
