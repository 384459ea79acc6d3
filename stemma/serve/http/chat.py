"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template, or, for a
model without one, the frontend's documented plain fallback (stemma.lang.chat_template), whose
turns end at the next `User:` / `System:` line; then as completions, with chat's shapes.

Message content is a string or a list of text parts (joined). `developer` is taken as `system`.
"""
from __future__ import annotations

import functools
from typing import Any, AsyncIterator

from fastapi import Request

from stemma import protocol as P
from stemma.lang.chat_template import PLAIN, ChatTemplate, for_codec
from stemma.lang.codec import HFCodec
from stemma.serve.http import generation as G
from stemma.serve.http.errors import ApiError, bad_field
from stemma.serve.http.openai_models import ChatCompletionRequest, ChatMessage
from stemma.serve.http.sampling import check_model, params_of
from stemma.serve.http.state import HttpState


def _content(msg: ChatMessage) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    return "".join(part.text for part in msg.content)


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": "system" if m.role == "developer" else m.role, "content": _content(m)}
            for m in messages]


@functools.lru_cache(maxsize=4)
def _template(tokenizer: Any) -> ChatTemplate:
    return for_codec(HFCodec(tokenizer))


def check_tools(req: ChatCompletionRequest) -> None:
    """Tool calls are not parsed here, so only `tool_choice: "none"` is served with tools (the
    template still shows them): as vLLM without a tool parser, "auto" (the default when tools
    are given), "required" or a named function is a 400, not a reply that silently ignores them."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice != "none":
        raise bad_field("tool_choice", f"tool_choice {choice!r} needs tool-call parsing, which this "
                                       "server does not do; send tool_choice \"none\" (the tools are "
                                       "then shown to the chat template) or no tools")


def render(state: HttpState, messages: list[dict[str, str]], add_generation_prompt: bool = True,
           continue_final: bool = False, tools: list[dict] | None = None) -> tuple[list[int], ChatTemplate]:
    """The prompt's token ids, and the template (its stops end the assistant turn)."""
    tok = state.tokenizer
    if tok is None:
        raise bad_field("messages", "this model has no tokenizer, so it cannot chat")
    template = _template(tok)
    if template is PLAIN:
        text = "".join(PLAIN.prefix(m["role"]) + m["content"] + PLAIN.suffix(m["role"])
                       for m in messages if m["role"] in PLAIN.roles)
        if continue_final and messages[-1]["role"] == "assistant":
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


def _start(state: HttpState, req: ChatCompletionRequest, ids: list[int], template: ChatTemplate) -> G.Run:
    if not ids:
        raise bad_field("messages", "the messages render to an empty prompt (no tokens)")
    if req.top_logprobs and not req.logprobs:
        raise bad_field("top_logprobs", "top_logprobs needs logprobs: true")
    prompts = [G.Prompt(ids)]
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    extra: dict[str, Any] = {}
    if req.logprobs:
        extra.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    extra["stop"], extra["stop_token_ids"] = stops_of(req, template)
    params = params_of(req, G.max_tokens_for(state, prompts, requested), **extra)
    return G.start(state, prompts, params, req.stream, call=req.program_call)


def _logprobs(state: HttpState, ids: list[int], logprobs, tops) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = G.token_text(state.tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

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
    check_tools(req)
    ids, template = await G.off_loop(render, state, as_dicts(req.messages), req.add_generation_prompt,
                                     req.continue_final_message, req.tools)
    run = _start(state, req, ids, template)
    want_logprobs = req.logprobs

    def body(outs: list[P.Finished]) -> dict:
        choices = [{"index": run.choice(o),
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": _logprobs(state, o.token_ids, o.logprobs, o.top_logprobs) if want_logprobs else None,
                    "finish_reason": G.finish_reason(o.finish_reason)} for o in outs]
        return {**_base(state, run, "chat.completion"), "choices": choices, "usage": G.usage(run, outs)}

    return await G.respond(request, run, lambda: _stream(state, req, run), body)


async def _stream(state: HttpState, req: ChatCompletionRequest, run: G.Run) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = req.logprobs
    base = _base(state, run, "chat.completion.chunk")
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, logprobs=None, reason=None) -> str:
        return G.sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": reason}], **extra})

    outs: list[P.Finished | None] = [None] * run.choices
    with run.peer:
        try:
            for i in range(run.choices):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for msg in G.replies(run):
                index = run.choice(msg)
                if isinstance(msg, P.TokenChunk):
                    if not msg.text and not msg.token_ids:
                        continue
                    logprobs = None
                    if want_logprobs and msg.token_ids:
                        logprobs = _logprobs(state, msg.token_ids, msg.logprobs, msg.top_logprobs)
                    yield chunk(index, {"content": msg.text}, logprobs)
                else:
                    outs[index] = msg
                    yield chunk(index, {}, None, G.finish_reason(msg.finish_reason))
            if include_usage:
                yield G.sse({**base, "choices": [], "usage": G.usage(run, outs)})
        except ApiError as exc:
            yield G.sse_error(exc)
    yield G.DONE
