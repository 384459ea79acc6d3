"""Running the generate requests of one HTTP request through the gateway, and what the
OpenAI-compatible routes build from their replies.

One HTTP request is one LocalPeer, with one GenerateReq per prompt (each with its `n`); choice
`p * n + j` is sequence j of prompt p, as OpenAI numbers them. The peer is closed when the HTTP
request ends in any way (done, error, client gone), which aborts what is still running.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from stemma import protocol as P
from stemma.program_call import ProgramCall
from stemma.sampling_params import SamplingParams
from stemma.serve.http.errors import ApiError, ClientGone, bad_field, from_server
from stemma.serve.http.state import HttpState, LocalPeer
from stemma.text.tokenizer import encode_prompt

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None          # the prompt as the client gave it, when it gave text


@dataclass
class Run:
    """The generate requests of one HTTP request, in flight."""
    peer: LocalPeer
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    rids: dict[str, int] = field(default_factory=dict)   # rid -> prompt index
    early: list[P.Message] = field(default_factory=list)  # replies read before the stream began
    constraint: str | None = None   # the request field a failed constraint is reported under
    native: bool = False            # /generate: its fields are SamplingParams' own, under sampling_params
    prompt_field: str = "prompt"    # the request's field of the prompt (chat: messages)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: secrets.token_hex(12))

    def choice(self, msg: P.TokenChunk | P.Finished) -> int:
        return self.rids[msg.rid] * self.params.n + msg.index

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.params.n


def program_call(data: dict[str, Any] | None) -> ProgramCall | None:
    """The request's `program_call` field, checked."""
    if data is None:
        return None
    try:
        return ProgramCall.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise bad_field("program_call", str(exc)) from None


def start(state: HttpState, prompts: list[Prompt], params: SamplingParams, stream: bool,
          program: str | None = None, call: dict[str, Any] | None = None, salt: str | None = None,
          constraint: str | None = None, native: bool = False, prompt_field: str = "prompt") -> Run:
    """Sends the run's requests. `constraint`: the field a constraint that fails to build is
    reported under, when not the one `params` names (a forced tool call's schema: tool_choice)."""
    checked = program_call(call)
    limit = state.engine.context_length
    for i, prompt in enumerate(prompts):
        if len(prompt.ids) + (params.max_new_tokens > 0) > limit:
            raise bad_field("prompt" if len(prompts) == 1 else f"prompt[{i}]",
                            f"the prompt has {len(prompt.ids)} tokens; with max_tokens "
                            f"{params.max_new_tokens} it does not fit the context of {limit} tokens")
    run = Run(state.open(), prompts, params, stream, constraint=constraint, native=native,
              prompt_field=prompt_field)
    for i, prompt in enumerate(prompts):
        rid = state.new_rid()
        run.rids[rid] = i
        run.peer.send(P.GenerateReq(rid=rid, input_ids=prompt.ids, params=params, stream=stream,
                                    salt=salt, program=program, call=checked))
    return run


async def replies(run: Run) -> AsyncIterator[P.TokenChunk | P.Finished]:
    """Every chunk and finish of the run, until all its sequences finished. An error reply
    raises ApiError (the peer closes, which aborts the others)."""
    left = run.choices
    while left:
        msg = run.early.pop(0) if run.early else await run.peer.get()
        _raise_for(run, msg)
        if isinstance(msg, P.Finished):
            left -= 1
        if isinstance(msg, (P.TokenChunk, P.Finished)):
            yield msg


def _raise_for(run: Run, msg: P.Message) -> None:
    """The ApiError of an error reply: the engine refused a request, or its constraint failed to
    build."""
    if isinstance(msg, P.ErrorMsg):
        raise from_server(msg, _http_field(run, msg.param))
    if isinstance(msg, P.Finished) and msg.finish_reason == "error":
        raise bad_field(_http_field(run, run.params.constraint_field), msg.meta.get("error", "the request failed"))


def _http_field(run: Run, param: str | None) -> str | None:
    """The request field that the engine's refusal names (`param`: a SamplingParams field or
    "prompt"): the OpenAI routes' name for it, or /generate's."""
    if param is None:
        return None
    if param == "prompt":
        return run.prompt_field
    if run.native:
        return f"sampling_params.{param}"
    if param in ("regex", "json_schema", "grammar"):
        return run.constraint or ("response_format" if param == "json_schema" else param)
    return {"max_new_tokens": "max_tokens", "logprob_start": "echo"}.get(param, param)


async def finished(run: Run) -> list[P.Finished]:
    """The Finished of every choice, in choice order."""
    out: list[P.Finished | None] = [None] * run.choices
    async for msg in replies(run):
        if isinstance(msg, P.Finished):
            out[run.choice(msg)] = msg
    return out  # type: ignore[return-value]


async def respond(request: Request, run: Run, stream: Callable[[], AsyncIterator[str]],
                  body: Callable[[list[P.Finished]], Any]):
    """The HTTP response of `run`: SSE from `stream()` when it streams, else JSON of `body(outs)`
    once every choice finished (aborted if the client leaves first). A stream begins with its
    first reply, so that a request the engine refuses (past a limit, a token id outside the
    vocabulary, a bad constraint) gets its 4xx status, as a vLLM server answers it, not an error
    event after a 200."""
    if run.stream:
        try:
            first = await unless_disconnected(request, run.peer.get())
            run.early.append(first)
            _raise_for(run, first)
        except BaseException:
            run.peer.close()
            raise
        return StreamingResponse(stream(), media_type="text/event-stream")
    with run.peer:
        outs = await unless_disconnected(request, finished(run))
    # off the loop too: a body decodes each token and top logprob (86k decodes, 0.16 s on the
    # tests' tiny tokenizer, for n=8 x 512 tokens x 20 tops), which would stall every stream
    return JSONResponse(await off_loop(body, outs))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (ClientGone) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


def usage(run: Run, outs: list[P.Finished]) -> dict[str, Any]:
    """OpenAI's usage object; a prompt counts once, its cached tokens those of its first sequence."""
    n = run.params.n
    prompt = sum(len(p.ids) for p in run.prompts)
    cached = sum(outs[i * n].meta.get("cached_tokens", 0) for i in range(len(run.prompts))
                 if outs[i * n] is not None)
    completion = sum(len(o.token_ids) for o in outs if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class StreamUsage:
    """stream_options: `include_usage` ends the stream with the usage chunk, and every chunk
    carries `usage` (null); with vLLM's `continuous_usage_stats` too, each chunk carries the
    usage of its choice so far."""

    def __init__(self, run: Run, options: Any):
        self.run = run
        self.final = bool(options and options.include_usage)
        self.continuous = self.final and options.continuous_usage_stats
        self.tokens = [0] * run.choices

    def count(self, msg: P.TokenChunk | P.Finished, index: int) -> None:
        if isinstance(msg, P.Finished):
            self.tokens[index] = len(msg.token_ids)
        else:
            self.tokens[index] += len(msg.token_ids)

    def field(self, index: int) -> dict[str, Any]:
        """What a chunk of choice `index` carries."""
        if not self.continuous:
            return {"usage": None} if self.final else {}
        prompt, completion = len(self.run.prompts[index // self.run.params.n].ids), self.tokens[index]
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}


def check_stream_options(req: Any) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_field("stream_options", "stream_options can only be given with stream: true")


def stop_reason(out: P.Finished) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the sequence, else None."""
    return out.meta.get("stop_reason")


def finish_reason(reason: str | None) -> str | None:
    return reason  # stemma's reasons are OpenAI's ("stop", "length"), plus "abort"


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def sse_error(exc: ApiError) -> str:
    return sse(exc.body())


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def max_tokens_for(state: HttpState, prompts: list[Prompt], requested: int | None,
                   field_name: str = "max_tokens") -> int:
    """`requested`, or what the context leaves after the longest prompt. A `requested` that the
    context cannot hold after a prompt that fits is refused, as vLLM refuses it (the engine would
    end the sequence early with finish_reason "length"); a prompt that does not fit is `start`'s."""
    context, longest = state.engine.context_length, max(len(p.ids) for p in prompts)
    if requested is None:
        return max(context - longest, 0)
    if longest < context < longest + requested:
        raise bad_field(field_name, f"{field_name} is too large: {requested}. The model's context is "
                                    f"{context} tokens and the prompt has {longest} "
                                    f"({requested} > {context} - {longest})")
    return requested


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread, for tokenizing and chat rendering: a long prompt tokenized
    on the event loop stalled every other stream of the server for as long (the tokenizer
    releases the GIL while it encodes)."""
    return await asyncio.to_thread(fn, *args)


def tokenize(state: HttpState, text: str, field_name: str) -> list[int]:
    """As the gateway tokenizes a ZeroMQ prompt (encode_prompt); a bad one is a 400 naming the field."""
    try:
        return encode_prompt(state.tokenizer, text, field_name)
    except ValueError as exc:
        raise bad_field(field_name, str(exc)) from None


def check_ids(state: HttpState, ids: list[int], field_name: str) -> list[int]:
    """Token ids as the client gave them; empty or out-of-vocabulary ones are a 400 naming the
    field (text prompts get the same rule from encode_prompt)."""
    if not ids:
        raise bad_field(field_name, f"{field_name} must hold at least one token")
    vocab = state.engine.vocab_size
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise bad_field(field_name, f"{field_name} holds token ids outside [0, {vocab}): {bad[0]}")
    return ids
