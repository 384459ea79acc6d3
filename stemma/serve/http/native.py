"""stemma's own routes: `/generate` (one prompt, all of SamplingParams: what
`stemma.connect("http://...")` speaks), `/end_program`, `/get_server_info`, `/health`, `/flush_cache`,
`/tokenize`, `/detokenize`, `/v1/models`.

`/generate` answers a RequestOutput as JSON (a list of them for n > 1, their rids suffixed `-i`
as Engine's are); streamed, SSE events `{index, text, token_ids, logprobs, top_logprobs}` per
chunk, `{index, finished: RequestOutput}` per finished sequence, then `[DONE]`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from stemma import protocol as P
from stemma.serve.http import generation as G
from stemma.serve.http.chat import as_dicts, render
from stemma.serve.http.errors import ApiError, bad_field, from_server
from stemma.serve.http.openai_models import DetokenizeRequest, EndProgramRequest, GenerateRequest, TokenizeRequest
from stemma.serve.http.sampling import check_model, native_params
from stemma.serve.http.state import HttpState

HEALTH_TIMEOUT_S = 5.0


def _output(out: P.Finished, rid: str, n: int) -> dict[str, Any]:
    return dataclasses.asdict(out.output(rid if n == 1 else f"{rid}-{out.index}"))


async def generate(state: HttpState, req: GenerateRequest, request: Request):
    if (req.text is None) == (req.input_ids is None):
        raise bad_field("text", "give exactly one of text and input_ids")
    params = native_params(req.sampling_params)
    ids = (G.check_ids(state, req.input_ids, "input_ids") if req.input_ids is not None
           else await G.off_loop(G.tokenize, state, req.text, "text"))
    run = G.start(state, [G.Prompt(ids, req.text)], params, req.stream, req.program, req.program_call,
                  salt=req.salt, native=True, prompt_field="text" if req.text is not None else "input_ids")
    rid = req.rid or next(iter(run.rids))

    def body(outs: list[P.Finished]):
        out = [_output(o, rid, params.n) for o in outs]
        return out[0] if params.n == 1 else out

    return await G.respond(request, run, lambda: _stream(run, rid), body)


async def _stream(run: G.Run, rid: str) -> AsyncIterator[str]:
    with run.peer:
        try:
            async for msg in G.replies(run):
                if isinstance(msg, P.TokenChunk):
                    yield G.sse({"index": msg.index, "text": msg.text, "token_ids": msg.token_ids,
                                 "logprobs": msg.logprobs, "top_logprobs": msg.top_logprobs})
                else:
                    yield G.sse({"index": msg.index, "finished": _output(msg, rid, run.params.n)})
        except ApiError as exc:
            yield G.sse_error(exc)
    yield G.DONE


async def _ask(state: HttpState, msg: P.Message, kind: type[P.Message], timeout: float = 30.0):
    reply = await state.call(msg, timeout)
    if isinstance(reply, P.ErrorMsg):
        raise from_server(reply)
    if not isinstance(reply, kind):
        raise ApiError(500, f"the engine answered {reply.TAG!r} to {msg.TAG!r}")
    return reply


async def server_info(state: HttpState) -> dict[str, Any]:
    info = await _ask(state, P.GetInfo(rid=state.new_rid()), P.Info)
    return {"model": info.model, "context_length": info.context_length,
            "vocab_size": info.vocab_size, "stats": info.stats}


async def health(state: HttpState) -> JSONResponse:
    try:
        await _ask(state, P.Health(rid=state.new_rid()), P.HealthOk, HEALTH_TIMEOUT_S)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=503)
    return JSONResponse({"status": "ok"})


def end_program(state: HttpState, req: EndProgramRequest) -> dict[str, Any]:
    """The program calls no more; nothing to wait for (the engine sends no reply)."""
    with state.open() as peer:
        peer.send(P.EndProgram(rid=state.new_rid(), program_id=req.program_id))
    return {"ok": True}


async def flush_cache(state: HttpState) -> dict[str, Any]:
    done = await _ask(state, P.FlushCache(rid=state.new_rid()), P.FlushDone)
    return {"ok": done.ok, "message": "flushed" if done.ok else "requests are running; not flushed"}


def tokenize(state: HttpState, req: TokenizeRequest) -> dict[str, Any]:
    state.check_ready()
    if req.model is not None:
        check_model(req.model, state.model_names())
    if (req.prompt is None) == (req.messages is None):
        raise bad_field("prompt", "give exactly one of prompt and messages")
    if req.messages is not None:
        ids, _ = render(state, as_dicts(req.messages), req.add_generation_prompt,
                        req.continue_final_message, req.tools)
    elif state.tokenizer is None:
        raise bad_field("prompt", "this model has no tokenizer")
    else:
        ids = list(state.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids)
    return {"count": len(ids), "max_model_len": state.engine.context_length, "tokens": ids}


def detokenize(state: HttpState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_ready()
    if req.model is not None:
        check_model(req.model, state.model_names())
    if state.tokenizer is None:
        raise bad_field("tokens", "this model has no tokenizer")
    if req.tokens:  # no tokens are the empty text (vLLM)
        G.check_ids(state, req.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


def model_card(state: HttpState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": 0, "owned_by": "stemma",
            "root": state.engine.model, "max_model_len": state.engine.context_length}


def models(state: HttpState) -> dict[str, Any]:
    state.check_ready()
    return {"object": "list", "data": [model_card(state)]}


def model(state: HttpState, model_id: str) -> dict[str, Any]:
    state.check_ready()
    if model_id not in state.model_names():
        raise ApiError(404, f"the model {model_id!r} does not exist here", param="model",
                       code="model_not_found")
    return model_card(state)
