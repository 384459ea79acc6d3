"""A backend over any OpenAI-compatible server (vLLM, SGLang, llama.cpp, stemma's own /v1 routes),
for programs run where stemma's native protocol is not served.

    backend = stemma.OpenAIBackend("http://127.0.0.1:8000/v1", "my-model")
    state = program.run(..., backend=backend)

It speaks HTTP with httpx directly; the `openai` package is not needed.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence
from urllib.parse import urlsplit

import httpx2

from stemma.lang.backends.base import Backend, OnText
from stemma.lang.chat_template import ChatTemplate, for_codec
from stemma.lang.codec import HFCodec, TokenCodec
from stemma.lang.errors import BackendUnreachable
from stemma.outputs import RequestOutput
from stemma.text.sse import SSE
from stemma.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODES = ("auto", "completions", "chat")
DIALECTS = ("openai", "vllm", "sglang", "stemma")

# the SamplingParams fields outside OpenAI's API that vLLM, SGLang and stemma take as extra
# top-level fields of the same request: field -> (request field, value when off)
_EXTRAS = {"top_k": ("top_k", -1), "min_p": ("min_p", 0.0),
           "repetition_penalty": ("repetition_penalty", 1.0),
           "min_new_tokens": ("min_tokens", 0), "ignore_eos": ("ignore_eos", False),
           "stop_token_ids": ("stop_token_ids", ()),
           "skip_special_tokens": ("skip_special_tokens", True)}


class OpenAIBackendError(RuntimeError):
    """The server refused a request (`status` is its HTTP status), or cannot do what the program
    needs (`status` None): a message names the server, and what it lacks."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class CharCodec(TokenCodec):
    """Without the model's tokenizer: a program's "token ids" are its text's Unicode code points.

    They never reach the server: prompts are sent as text, which the server tokenizes (adding
    its BOS), and outputs come back as text."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))


# Chat turns, when the server renders them (chat mode): the program's text marks each turn as
# ChatML does, and each gen's prompt is read back into messages.
CHATML = ChatTemplate(name="chatml-messages", roles={
    role: (f"<|im_start|>{role}\n", "<|im_end|>\n") for role in ("system", "user", "assistant")})
_START = "<|im_start|>"
_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)
_OPEN = re.compile(r"<\|im_start\|>(system|user|assistant)\n", re.S)


def messages_of(text: str) -> tuple[list[dict[str, str]], str | None]:
    """The closed turns of a chat-mode prompt, and the text of the assistant turn it leaves open
    (None when it ends after a closed turn). ValueError for text outside turns."""
    messages, at = [], 0
    for match in _TURN.finditer(text):
        if text[at:match.start()].strip():
            raise ValueError(f"text outside a chat turn: {text[at:match.start()][:60]!r}")
        messages.append({"role": match.group(1), "content": match.group(2)})
        at = match.end()
    rest = text[at:]
    opened = _OPEN.match(rest.lstrip())
    if opened is None:
        if rest.strip():
            raise ValueError(f"text outside a chat turn: {rest[:60]!r}")
        return messages, None
    if opened.group(1) != "assistant":
        raise ValueError(f"the prompt ends inside an open {opened.group(1)} turn")
    return messages, rest.lstrip()[opened.end():]


@dataclass
class _Reply:
    """What one completion returned, streamed or not."""
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None


class OpenAIBackend(Backend):
    """Programs on an OpenAI-compatible server (`base_url`: its API root, such as
    http://host:8000/v1; a bare http://host:port gets /v1), serving `model` (None: the first
    that /v1/models lists).

    **Token ids.** Programs keep token ids (see codec.py), but an OpenAI server speaks text.
    - `tokenizer=` (the served model's transformers tokenizer, or a local path to load it from):
      the program's ids are the model's, prompts are sent as token ids, so the server sees
      exactly the tokens the native backends would send; turns use the tokenizer's own chat
      template, and select scores exactly the choice's tokens. Generated text is re-encoded with
      the tokenizer (the server returns text, unless it sends `token_ids` with its choices), so
      the ids a program keeps after a gen may differ from those the model sampled: a special
      token sampled mid-output, which the text skips, is gone from the next prompt.
    - without one, the ids are Unicode code points (CharCodec): prompts are sent as text, and
      the server tokenizes them (and adds its BOS), so a program cannot start with a gen on an
      empty prompt, token boundaries are the server's, and the prefix cache may miss across them.

    **mode.**
    - "completions": every call goes to /v1/completions; turns are rendered as text by the
      tokenizer's chat template, else the plain "User: ..." fallback (see chat_template.py).
    - "chat": each gen goes to /v1/chat/completions with the program's turns as messages, so the
      server applies the model's chat template. The program's text marks turns in ChatML;
      a gen must open an assistant turn (continuing a partly written one needs dialect "vllm",
      "sglang" or "stemma"), and text outside turns is refused. select is not available: chat
      completions return no prompt logprobs. It needs no tokenizer (one given is refused).
    - "auto" (the default): "completions" when a tokenizer is given; without one, turns are
      marked in ChatML, a gen whose prompt has turns goes to chat and any other to completions.

    **select** scores each choice with `echo=True, logprobs=1, max_tokens=0` on /v1/completions:
    the logprobs the server returns for the prompt's last tokens, those of the choice. Without a
    tokenizer, the choice's tokens are the server's: the prompt's token count (its usage) less the
    prefix's, which `prefill` (the interpreter's, before scoring) records; a token that straddles
    the boundary counts as the choice's. A server that returns no prompt logprobs for echo gets a
    clear OpenAIBackendError. A server that refuses max_tokens=0 is asked for one token, which is
    ignored. `prefill` is a max_tokens=0 completion, which warms the server's prefix cache.

    **dialect** says which sampling fields the server takes. "openai": OpenAI's own (max_tokens,
    temperature, top_p, stop, seed, presence and frequency penalties, logit_bias, logprobs,
    json_schema as response_format); "vllm", "sglang" and "stemma" add top_k, min_p,
    repetition_penalty, min_tokens, ignore_eos, stop_token_ids and skip_special_tokens as extra
    fields, and regex (vLLM: structured_outputs; SGLang, stemma: regex) and json_schema (vLLM:
    structured_outputs; SGLang, stemma: json_schema); "stemma" also takes grammar (Lark). A gen
    that sets a field the dialect lacks raises ValueError rather than being sampled otherwise.
    Outputs carry the chosen tokens' logprobs when asked, never top_logprobs (the server names
    tokens by text, not id), and meta holds the usage the server reports.

    `stats()` sums what the server reported for this backend's requests (an OpenAI server has no
    engine counters to read).
    """

    reuses_prefix = False  # each request sends its whole prompt: num_api_spec_tokens speculates

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 mode: str = "auto", *, tokenizer: PreTrainedTokenizerBase | str | None = None,
                 dialect: str = "openai", timeout: float | None = 600.0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
        if mode == "chat" and tokenizer is not None:
            raise ValueError("mode='chat' sends the program's turns as text messages, so it takes no "
                             "tokenizer; a tokenizer is for mode='completions' (or 'auto')")
        url = base_url.rstrip("/")
        if not urlsplit(url).path:
            url += "/v1"
        self.base_url = url
        self.model = model
        self.mode = mode
        self.dialect = dialect
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if isinstance(tokenizer, str):
            from stemma.text.tokenizer import load_tokenizer
            path, tokenizer = tokenizer, load_tokenizer(tokenizer)
            if tokenizer is None:
                raise ValueError(f"no tokenizer files in {path!r}")
        self._codec: TokenCodec = HFCodec(tokenizer) if tokenizer is not None else CharCodec()
        self._token_ids = tokenizer is not None
        self._clients: dict[asyncio.AbstractEventLoop, httpx2.AsyncClient] = {}
        self._prefix_tokens: dict[str, int] = {}  # prompt text -> the server's token count
        self._echo_max_tokens = 0                 # 1 once the server refused 0
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                         "requests": 0}
        self._running = 0

    # ---- Backend ----
    @property
    def codec(self) -> TokenCodec:
        return self._codec

    @cached_property
    def chat_template(self) -> ChatTemplate:
        if self._marks_turns:
            return CHATML
        return for_codec(self._codec)

    @property
    def _marks_turns(self) -> bool:
        return self.mode == "chat" or (self.mode == "auto" and not self._token_ids)

    async def generate(self, ids: list[int], params: SamplingParams,
                       on_text: OnText | None = None) -> RequestOutput:
        if params.n != 1:
            raise ValueError(f"OpenAIBackend.generate takes n=1, got {params.n}")
        if not ids:
            raise ValueError("prompt must hold at least one token")
        if params.logprob_start is not None:
            return await self._score(ids, params.logprob_start)
        if params.max_new_tokens == 0:
            return await self.prefill(ids)
        text = None if self._token_ids else self._codec.decode(ids)
        if self.mode == "chat" or (self.mode == "auto" and text is not None and _START in text):
            return await self._chat(text, params, on_text)
        return await self._complete(ids if text is None else text, params, on_text)

    async def prefill(self, ids: list[int]) -> RequestOutput:
        text = None if self._token_ids else self._codec.decode(ids)
        if text is not None and self._marks_turns and (self.mode == "chat" or _START in text):
            return _output("", [], "length", {})  # the chat route computes its own prompt
        data = await self._echo_request(ids if text is None else text, echo=False)
        usage = data.get("usage") or {}
        if text is not None and "prompt_tokens" in usage:
            self._remember(text, int(usage["prompt_tokens"]))
        return _output("", [], "length", self._meta(usage))

    async def stats(self) -> dict[str, Any]:
        c = self.counters
        return {**c, "cache_hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                "tokens_per_s": 0.0, "running": self._running, "queue": 0}

    def close(self) -> None:
        for loop, client in list(self._clients.items()):
            if loop.is_closed():
                continue
            if loop.is_running():
                loop.create_task(client.aclose())
            else:
                loop.run_until_complete(client.aclose())
        self._clients.clear()

    # ---- HTTP ----
    def _client(self) -> httpx2.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            for old in [lp for lp in self._clients if lp.is_closed()]:  # a finished run's loop
                del self._clients[old]
            # no idle connections: a run's loop closes when it ends, and would leave them open
            self._clients[loop] = httpx2.AsyncClient(base_url=self.base_url, headers=self._headers,
                                                     timeout=httpx2.Timeout(self.timeout),
                                                     limits=httpx2.Limits(max_keepalive_connections=0))
        return self._clients[loop]

    def _unreachable(self, exc: Exception) -> Exception:
        if isinstance(exc, httpx2.TimeoutException):
            return OpenAIBackendError(f"the server at {self.base_url} did not answer in time "
                                      f"(timeout {self.timeout} s): {exc}")
        return BackendUnreachable(f"the OpenAI-compatible server at {self.base_url} is unreachable: "
                                  f"{exc}")

    def _refused(self, path: str, status: int, content: bytes) -> OpenAIBackendError:
        try:
            body = json.loads(content)
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            message = error.get("message") or json.dumps(error)
        elif isinstance(body, dict) and ("detail" in body or "message" in body or error):
            message = str(body.get("detail") or body.get("message") or error)
        else:
            message = content.decode("utf-8", "replace").strip()[:500] or "no message"
        return OpenAIBackendError(f"the server at {self.base_url} refused {path} (HTTP {status}): "
                                  f"{message}", status)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self._client().post(path, json=body)
        except httpx2.TransportError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise self._refused(path, response.status_code, response.content)
        try:
            data = response.json()
        except ValueError:
            raise OpenAIBackendError(f"the server at {self.base_url} answered {path} with no JSON: "
                                     f"{response.text[:200]!r}") from None
        if not isinstance(data, dict):
            raise OpenAIBackendError(f"the server at {self.base_url} answered {path} with "
                                     f"{type(data).__name__}, not an object")
        return data

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The JSON events of a streamed request, until [DONE]."""
        client = self._client()
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    raise self._refused(path, response.status_code, await response.aread())
                sse = SSE()
                async for line in response.aiter_lines():
                    data = sse.feed(line)
                    if data is None:
                        continue
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise OpenAIBackendError(f"the server at {self.base_url} streamed a bad "
                                                 f"event: {data[:200]!r}") from None
                    if isinstance(event, dict) and "error" in event:
                        error = event["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        raise OpenAIBackendError(f"the server at {self.base_url} failed {path} "
                                                 f"while streaming: {message}")
                    if isinstance(event, dict):
                        yield event
                raise OpenAIBackendError(f"the stream of {path} from {self.base_url} ended before "
                                         "[DONE]: the server or a proxy cut it short")
        except httpx2.TransportError as exc:
            raise self._unreachable(exc) from exc

    async def _model(self) -> str:
        if self.model is None:
            try:
                response = await self._client().get("/models")
            except httpx2.TransportError as exc:
                raise self._unreachable(exc) from exc
            if response.status_code >= 400:
                raise self._refused("/models", response.status_code, response.content)
            try:
                models = response.json()["data"]
                self.model = models[0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise OpenAIBackendError(f"the server at {self.base_url} lists no model at /models; "
                                         f"pass OpenAIBackend(..., model=...)") from None
        return self.model

    # ---- requests ----
    def _sampling(self, params: SamplingParams, chat: bool) -> dict[str, Any]:
        """The request fields of `params`; ValueError for one the dialect cannot send."""
        body: dict[str, Any] = {"max_tokens": params.max_new_tokens, "temperature": params.temperature}
        if params.top_p != 1.0:
            body["top_p"] = params.top_p
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.presence_penalty:
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            body["frequency_penalty"] = params.frequency_penalty
        bias = getattr(params, "logit_bias", ())
        if bias:
            body["logit_bias"] = {str(t): b for t, b in bias}
        if params.logprobs or params.top_logprobs:
            if chat:
                body["logprobs"] = True
            else:
                body["logprobs"] = max(params.top_logprobs, 1)
        extended = self.dialect != "openai"
        for name, (field, off) in _EXTRAS.items():
            value = getattr(params, name)
            if name == "stop_token_ids" and not extended:  # the end of turn a gen inside an
                ends = self.chat_template.stop_ids        # assistant turn gets: the server's
                value = tuple(t for t in value if t not in ends)  # own EOS handling stops there
            if value == off:
                continue
            if not extended:
                raise ValueError(self._lacks(name))
            body[field] = list(value) if isinstance(value, tuple) else value
        if params.regex is not None:
            if not extended:
                raise ValueError(self._lacks("regex"))
            if self.dialect == "vllm":
                body["structured_outputs"] = {"regex": params.regex}
            else:
                body["regex"] = params.regex
        if params.json_schema is not None:
            schema = json.loads(params.json_schema)
            if self.dialect == "vllm":
                body["structured_outputs"] = {"json": schema}
            elif self.dialect in ("sglang", "stemma"):
                body["json_schema"] = params.json_schema
            else:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "output", "schema": schema,
                                                           "strict": True}}
        if params.grammar is not None:
            if self.dialect != "stemma":
                raise ValueError(f"grammar (a Lark grammar) has no equivalent in the {self.dialect!r} "
                                 f"dialect of OpenAI's API; use regex or json_schema, or "
                                 f"dialect='stemma' for a stemma server")
            body["grammar"] = params.grammar
        return body

    def _lacks(self, name: str) -> str:
        return (f"{name} is not a field of OpenAI's API; if the server at {self.base_url} takes "
                f"vLLM / SGLang extra fields, pass OpenAIBackend(..., dialect='vllm'), 'sglang' or "
                f"'stemma'")

    def _meta(self, usage: dict[str, Any] | None, latency: float | None = None) -> dict[str, Any]:
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        meta = {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
                "cached_tokens": int(details.get("cached_tokens") or 0),
                "completion_tokens": int(usage.get("completion_tokens") or 0)}
        if latency is not None:
            meta["latency"] = latency
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += meta["prompt_tokens"]
        self.counters["cached_tokens"] += meta["cached_tokens"]
        self.counters["generated_tokens"] += meta["completion_tokens"]
        self.token_usage.add(meta)
        return meta

    async def _run(self, path: str, body: dict[str, Any], chat: bool,
                   on_text: OnText | None) -> _Reply:
        """One completion, streamed to `on_text` when given."""
        self._running += 1
        try:
            if on_text is None:
                data = await self._post(path, body)
                choices = data.get("choices") or []
                if not choices:
                    raise OpenAIBackendError(f"the server at {self.base_url} answered {path} with "
                                             f"no choices")
                choice = choices[0]
                text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
                reply = _Reply(text=text or "", finish_reason=choice.get("finish_reason"),
                               usage=data.get("usage"),
                               token_ids=choice.get("token_ids") if not chat else None)
                reply.logprobs = _logprobs(choice.get("logprobs"), chat)
                return reply
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            reply, parts, logprobs = _Reply(), [], []
            async for event in self._events(path, body):
                if event.get("usage"):
                    reply.usage = event["usage"]
                for choice in event.get("choices") or ():
                    if choice.get("index", 0) != 0:
                        continue
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        parts.append(piece)
                        on_text(piece)
                    if choice.get("finish_reason"):
                        reply.finish_reason = choice["finish_reason"]
                    logprobs.extend(_logprobs(choice.get("logprobs"), chat) or ())
            reply.text = "".join(parts)
            reply.logprobs = logprobs if "logprobs" in body else None
            return reply
        finally:
            self._running -= 1

    def _finish(self, reply: _Reply, params: SamplingParams) -> RequestOutput:
        ids = reply.token_ids if (self._token_ids and reply.token_ids) else self._codec.encode(reply.text)
        logprobs = reply.logprobs if (params.logprobs or params.top_logprobs) else None
        return _output(reply.text, list(ids), reply.finish_reason, self._meta(reply.usage), logprobs)

    async def _complete(self, prompt: str | list[int], params: SamplingParams,
                        on_text: OnText | None) -> RequestOutput:
        body = {"model": await self._model(), "prompt": prompt, **self._sampling(params, chat=False)}
        return self._finish(await self._run("/completions", body, False, on_text), params)

    async def _chat(self, text: str | None, params: SamplingParams,
                    on_text: OnText | None) -> RequestOutput:
        if text is None:
            raise ValueError("chat mode takes no tokenizer")
        try:
            messages, open_turn = messages_of(text)
        except ValueError as exc:
            raise ValueError(f"the chat route sends a program's turns as messages, and this prompt "
                             f"has {exc}; keep all text inside system/user/assistant turns, or pass "
                             f"OpenAIBackend(..., mode='completions') to send it as one text prompt") from None
        if open_turn is None:
            raise ValueError("on the chat route a gen must open an assistant turn (write "
                             "assistant(gen(...))); pass mode='completions' to generate anywhere")
        if not messages:
            raise ValueError("on the chat route a gen needs a turn before its assistant turn")
        body: dict[str, Any] = {"model": await self._model(), "messages": messages,
                                **self._sampling(params, chat=True)}
        if params.top_logprobs:
            body["top_logprobs"] = params.top_logprobs
        if open_turn:
            if self.dialect == "openai":
                raise ValueError("OpenAI's chat API cannot continue a partly written assistant turn "
                                 f"({open_turn[:40]!r}); start the turn with the gen, or pass "
                                 "dialect='vllm', 'sglang' or 'stemma' (continue_final_message)")
            body["messages"] = messages + [{"role": "assistant", "content": open_turn}]
            body.update(continue_final_message=True, add_generation_prompt=False)
        return self._finish(await self._run("/chat/completions", body, True, on_text), params)

    # ---- select ----
    def _remember(self, text: str, count: int) -> None:
        if len(self._prefix_tokens) > 256:
            self._prefix_tokens.pop(next(iter(self._prefix_tokens)))
        self._prefix_tokens[text] = count

    async def _echo_request(self, prompt: str | list[int], echo: bool) -> dict[str, Any]:
        """A completion that generates nothing (one token, ignored, where 0 is refused); with
        `echo`, the prompt's logprobs."""
        body: dict[str, Any] = {"model": await self._model(), "prompt": prompt,
                                "max_tokens": self._echo_max_tokens, "temperature": 0.0}
        if echo:
            body.update(echo=True, logprobs=1)
        try:
            return await self._post("/completions", body)
        except OpenAIBackendError as exc:
            if self._echo_max_tokens == 0 and exc.status in (400, 422):
                self._echo_max_tokens = 1
                body["max_tokens"] = 1
                return await self._post("/completions", body)
            raise

    async def _prompt_tokens(self, text: str) -> int:
        if text not in self._prefix_tokens:
            try:
                usage = (await self._echo_request(text, echo=False)).get("usage") or {}
            except OpenAIBackendError as exc:
                if exc.status != 400 or text.strip():
                    raise
                usage = {"prompt_tokens": 0}  # whitespace that is no token on its own
                                              # (unconditional_likelihood_normalized's context)
            if "prompt_tokens" not in usage:
                raise OpenAIBackendError(f"the server at {self.base_url} reports no "
                                         f"usage.prompt_tokens; select needs it, without a "
                                         f"tokenizer, to find where each choice starts")
            self._remember(text, int(usage["prompt_tokens"]))
        return self._prefix_tokens[text]

    async def _score(self, ids: list[int], start: int) -> RequestOutput:
        """The logprobs of the prompt's tokens from position `start` on (the choice's)."""
        if start <= 0 or start >= len(ids):
            raise ValueError(f"logprob_start must be inside the prompt, got {start} of {len(ids)}")
        text = None if self._token_ids else self._codec.decode(ids)
        if self._marks_turns and (self.mode == "chat" or _START in (text or "")):
            raise OpenAIBackendError(
                "select needs the logprobs of the prompt's tokens, which the chat route does not "
                "return; a select after chat turns needs the turns rendered as text: pass "
                "OpenAIBackend(..., tokenizer=...) for the model's own template, or "
                "mode='completions' for the plain one")
        prefix_count = None if text is None else await self._prompt_tokens(self._codec.decode(ids[:start]))
        data = await self._echo_request(ids if text is None else text, echo=True)
        choices = data.get("choices") or [{}]
        values = (choices[0].get("logprobs") or {}).get("token_logprobs")
        usage = data.get("usage") or {}
        if not values:
            raise OpenAIBackendError(
                f"the server at {self.base_url} returned no prompt logprobs for echo=True "
                f"(/completions with logprobs=1); select needs them to score its choices")
        count = int(usage.get("prompt_tokens") or 0)
        if not count:
            if self._echo_max_tokens:
                raise OpenAIBackendError(f"the server at {self.base_url} reports no "
                                         f"usage.prompt_tokens; select needs it to find the prompt's "
                                         f"logprobs among the echoed tokens")
            count = len(values)
        prompt_lps = values[:count]
        tail = len(ids) - start if text is None else max(count - prefix_count, 1)
        if len(prompt_lps) < tail:
            raise OpenAIBackendError(f"the server at {self.base_url} echoed {len(prompt_lps)} prompt "
                                     f"logprobs for a prompt of {count} tokens")
        scored = prompt_lps[len(prompt_lps) - tail:]
        if text is not None and len(scored) == len(prompt_lps):
            scored = [lp for lp in scored[:1] if lp is not None] + scored[1:]  # the first token
        if not scored:                                    # has no logprob: nothing before it
            raise OpenAIBackendError(f"the choice's only token starts the prompt, and the server at "
                                     f"{self.base_url} adds no BOS before it to score it from; pass "
                                     f"OpenAIBackend(..., tokenizer=...) to score token ids")
        if any(lp is None for lp in scored):
            raise OpenAIBackendError(f"the server at {self.base_url} returned no logprob for some of "
                                     f"the scored prompt tokens; select needs them")
        meta = self._meta({**usage, "completion_tokens": 0})
        return _output("", [], "length", meta, prompt_logprobs=[float(lp) for lp in scored])


def _logprobs(value: Any, chat: bool) -> list[float] | None:
    if not isinstance(value, dict):
        return None
    if chat:
        content = value.get("content")
        return [float(item["logprob"]) for item in content] if isinstance(content, list) else None
    values = value.get("token_logprobs")
    return [float(lp) for lp in values if lp is not None] if isinstance(values, list) else None


def _output(text: str, ids: list[int], reason: str | None, meta: dict[str, Any],
            logprobs: list[float] | None = None,
            prompt_logprobs: list[float | None] | None = None) -> RequestOutput:
    return RequestOutput(rid="", text=text, token_ids=ids, finish_reason=reason, logprobs=logprobs,
                         prompt_logprobs=prompt_logprobs, meta=meta)


def OpenAI(model_name: str, is_chat_model: bool | None = None, *, base_url: str | None = None,
           api_key: str | None = None, **options: Any) -> OpenAIBackend:
    """SGLang's `sgl.OpenAI(model_name)`: an OpenAIBackend on OpenAI's API (or `base_url`;
    OPENAI_BASE_URL, OPENAI_API_KEY as the openai package reads them). `is_chat_model`: True sends
    gens to chat completions, False to completions, None decides per gen (mode "auto").
    `options`: OpenAIBackend's (tokenizer=, dialect=, timeout=)."""
    import os
    url = base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
    mode = "auto" if is_chat_model is None else ("chat" if is_chat_model else "completions")
    return OpenAIBackend(url, model_name, api_key or os.environ.get("OPENAI_API_KEY"), mode, **options)


def _vendor(name: str):
    def unsupported(*args: Any, **kwargs: Any):
        raise NotImplementedError(
            f"sgl.{name} is not provided: stemma speaks OpenAI's API (stemma.OpenAIBackend, "
            f"stemma.OpenAI) and its own; put {name}'s models behind an OpenAI-compatible gateway "
            f"and use OpenAIBackend(base_url, model)")
    unsupported.__name__ = name
    unsupported.__doc__ = f"SGLang's {name} backend: not provided (NotImplementedError)."
    return unsupported


Anthropic = _vendor("Anthropic")
LiteLLM = _vendor("LiteLLM")
VertexAI = _vendor("VertexAI")
