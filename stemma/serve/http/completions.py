"""`POST /v1/completions`, as OpenAI's: plain, streamed, several prompts, n, logprobs, echo (with
prompt logprobs, for scoring harnesses) and usage.

Echoed prompt positions carry the logprob of the prompt token itself (None for the first); their
`top_logprobs` hold that token only, since the engine computes no prompt alternatives. Streamed,
the echo comes first, as text alone.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request

from stemma import protocol as P
from stemma.serve.http import generation as G
from stemma.serve.http.errors import ApiError, bad_field
from stemma.serve.http.openai_models import CompletionRequest
from stemma.serve.http.sampling import check_model, constraint_field, params_of
from stemma.serve.http.state import HttpState


def _prompts(state: HttpState, prompt: Any) -> list[G.Prompt]:
    if isinstance(prompt, str):
        return [G.Prompt(G.tokenize(state, prompt, "prompt"), prompt)]
    if prompt and isinstance(prompt[0], int):
        return [G.Prompt(G.check_ids(state, list(prompt), "prompt"))]
    if not prompt:
        raise bad_field("prompt", "prompt must not be an empty list")
    out = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(G.Prompt(G.tokenize(state, item, f"prompt[{i}]"), item))
        else:
            out.append(G.Prompt(G.check_ids(state, list(item), f"prompt[{i}]")))
    return out


def _echo_text(state: HttpState, prompt: G.Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return state.tokenizer.decode(prompt.ids) if state.tokenizer is not None else ""


class Logprobs:
    """The completions logprobs object, built position by position."""

    def __init__(self, state: HttpState, offset: int = 0):
        self.state = state
        self.offset = offset
        self.body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                      "text_offset": []}

    def add(self, token: int, logprob: float | None, top: dict[str, float] | None) -> None:
        text = G.token_text(self.state.tokenizer, token)
        self.body["tokens"].append(text)
        self.body["token_logprobs"].append(logprob)
        self.body["top_logprobs"].append(top)
        self.body["text_offset"].append(self.offset)
        self.offset += len(text)

    def add_prompt(self, ids: list[int], logprobs: list[float | None]) -> None:
        for token, lp in zip(ids, logprobs):
            self.add(token, lp, None if lp is None else {G.token_text(self.state.tokenizer, token): lp})

    def add_output(self, ids: list[int], logprobs: list[float] | None, tops) -> None:
        for i, token in enumerate(ids):
            logprob = logprobs[i] if logprobs is not None else None
            if tops is not None:  # most likely first: two ids decoding alike keep the likelier
                top = {}
                for t, lp in tops[i]:
                    top.setdefault(G.token_text(self.state.tokenizer, t), lp)
                if logprob is not None:  # the chosen token is listed too, sampled outside the top k
                    top.setdefault(G.token_text(self.state.tokenizer, token), logprob)  # (OpenAI, vLLM)
            else:  # `logprobs: 0`: no alternatives, but the chosen token is listed (as OpenAI, vLLM)
                top = None if logprob is None else {G.token_text(self.state.tokenizer, token): logprob}
            self.add(token, logprob, top)


def _choice(state: HttpState, req: CompletionRequest, run: G.Run, out: P.Finished) -> dict:
    prompt = run.prompts[run.rids[out.rid]]
    text, logprobs = out.text, None
    prefix = _echo_text(state, prompt) if req.echo else ""
    if req.logprobs is not None:
        lp = Logprobs(state)
        if req.echo:
            lp.add_prompt(prompt.ids, out.prompt_logprobs or [None] * len(prompt.ids))
        lp.add_output(out.token_ids, out.logprobs, out.top_logprobs)
        logprobs = lp.body
    return {"index": run.choice(out), "text": prefix + text, "logprobs": logprobs,
            "finish_reason": G.finish_reason(out.finish_reason), "stop_reason": G.stop_reason(out)}


def _base(state: HttpState, run: G.Run) -> dict:
    return {"id": f"cmpl-{run.id}", "object": "text_completion", "created": run.created,
            "model": state.model_id}


def _check(state: HttpState, req: CompletionRequest) -> None:
    check_model(req.model, state.model_names())
    G.check_stream_options(req)
    if req.suffix:
        raise bad_field("suffix", "suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_field("best_of", "best_of must equal n (stemma returns every sequence it samples)")


def _start(state: HttpState, req: CompletionRequest, prompts: list[G.Prompt]) -> G.Run:
    extra = {}
    if req.logprobs is not None:
        extra.update(logprobs=True, top_logprobs=req.logprobs)
        if req.echo and not req.stream:  # a streamed echo is the prompt's text alone
            extra["logprob_start"] = 0
    params = params_of(req, G.max_tokens_for(state, prompts, req.max_tokens), **extra)
    return G.start(state, prompts, params, req.stream, call=req.program_call, constraint=constraint_field(req))


async def create(state: HttpState, req: CompletionRequest, request: Request):
    _check(state, req)
    run = _start(state, req, await G.off_loop(_prompts, state, req.prompt))

    def body(outs: list[P.Finished]) -> dict:
        return {**_base(state, run), "choices": [_choice(state, req, run, o) for o in outs],
                "usage": G.usage(run, outs)}

    return await G.respond(request, run, lambda: _stream(state, req, run), body)


async def _stream(state: HttpState, req: CompletionRequest, run: G.Run) -> AsyncIterator[str]:
    usage = G.StreamUsage(run, req.stream_options)
    base = _base(state, run)

    def chunk(index: int, text: str, logprobs=None, reason=None, stop_reason=None) -> str:
        return G.sse({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                           "finish_reason": reason, "stop_reason": stop_reason}],
                      **usage.field(index)})

    outs: list[P.Finished | None] = [None] * run.choices
    offsets = [0] * run.choices
    with run.peer:
        try:
            if req.echo:
                for i in range(run.choices):
                    text = _echo_text(state, run.prompts[i // req.n])
                    offsets[i] = len(text)
                    yield chunk(i, text)
            async for msg in G.replies(run):
                index = run.choice(msg)
                usage.count(msg, index)
                if isinstance(msg, P.TokenChunk):
                    if not msg.text and not msg.token_ids:
                        continue
                    logprobs = None
                    if req.logprobs is not None and msg.token_ids:
                        lp = Logprobs(state, offsets[index])
                        lp.add_output(msg.token_ids, msg.logprobs, msg.top_logprobs)
                        offsets[index] = lp.offset
                        logprobs = lp.body
                    yield chunk(index, msg.text, logprobs)
                else:
                    outs[index] = msg
                    yield chunk(index, "", None, G.finish_reason(msg.finish_reason), G.stop_reason(msg))
            if usage.final:
                yield G.sse({**base, "choices": [], "usage": G.usage(run, outs)})
        except ApiError as exc:
            yield G.sse_error(exc)
    yield G.DONE
