"""A backend over a stemma server, through its client (`stemma.connect`: the ZeroMQ Client, or the
HttpClient for an http:// address); the embedded default (`stemma.Runtime()`, started on first
use) is one too.

The program's token ids are made here, with the served model's own tokenizer, which is loaded
from the model path the server reports (so the server must share this machine's files), unless
one is passed in.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING, Any

from stemma.lang.backends.base import CURRENT_CALL, Backend, OnText
from stemma.lang.codec import HFCodec, TokenCodec
from stemma.lang.errors import BackendUnreachable
from stemma.client.sync import Client, connect
from stemma.client.core import CONNECTION_LOST, WRONG_PROTOCOL, RequestTimeout, ServerError, Unreachable
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stemma.client.http import HttpClient


class RemoteBackend(Backend):
    def __init__(self, client: Client | HttpClient | str, tokenizer: PreTrainedTokenizerBase | None = None,
                 connect_timeout: float = 30.0):
        """`client`: a stemma.connect() client (ZeroMQ or HTTP) or an address (tcp://, ipc://,
        http://, https://); `tokenizer`: the served model's tokenizer, when this machine cannot
        load it from the path the server reports."""
        self.client = connect(client, connect_timeout=connect_timeout) if isinstance(client, str) else client
        self.connect_timeout = connect_timeout
        self._codec: TokenCodec | None = HFCodec(tokenizer) if tokenizer is not None else None
        self._codec_lock = threading.Lock()  # programs on a thread pool ask for it at once

    def _unreachable(self, why: str) -> BackendUnreachable:
        return BackendUnreachable(f"the stemma server at {self.client.address} is unreachable: {why} "
                                  f"(is `stemma serve` running there?)")

    def _codec_from(self, info: dict[str, Any]) -> TokenCodec:
        from stemma.text.tokenizer import load_tokenizer
        try:
            tokenizer = load_tokenizer(info["model"])
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer of {info['model']!r}, served at "
                             f"{self.client.address}: {exc}; pass RemoteBackend(client, tokenizer=...)") from exc
        return HFCodec(tokenizer)

    @property
    def codec(self) -> TokenCodec:
        if self._codec is None:
            with self._codec_lock:  # one load: the sync client's socket and transformers' lazy
                if self._codec is None:  # imports are not for several threads at once
                    self._codec = self._load_codec()
        return self._codec

    def _load_codec(self) -> TokenCodec:
        try:
            if hasattr(self.client, "check_protocol"):  # an HttpClient: not at a ZeroMQ port
                self.client.check_protocol()
            info = self.client.info(timeout=self.connect_timeout)
        except Unreachable as exc:  # the client's connect limit: its message names the address
            raise BackendUnreachable(exc.message) from None
        except RequestTimeout:
            raise self._unreachable(f"no answer within {self.connect_timeout:g} s") from None
        except ServerError as exc:
            raise self._wrap(exc) from exc
        return self._codec_from(info)

    def _wrap(self, exc: ServerError) -> Exception:
        if exc.code == WRONG_PROTOCOL:  # reached, but it speaks the other protocol: say which
            return BackendUnreachable(exc.message)
        return self._unreachable(exc.message) if exc.code == CONNECTION_LOST else exc

    async def generate(self, ids: list[int], params: SamplingParams,
                       on_text: OnText | None = None) -> RequestOutput:
        call = CURRENT_CALL.get()
        try:
            if on_text is None:
                output = await self.client.agenerate(ids, params, call=call)
            else:
                stream = self.client.astream(ids, params, call=call)
                async for delta in stream:
                    on_text(delta)
                output = stream.output
        except ServerError as exc:
            error = self._wrap(exc)
            if error is exc:
                raise
            raise error from exc
        self.token_usage.add(output.meta)
        return output

    async def end_program(self, program_id: str) -> None:
        await self.client.aend_program(program_id)

    async def stats(self) -> dict[str, Any]:
        return (await self.client.ainfo(timeout=self.connect_timeout))["stats"]

    def close(self) -> None:
        self.client.close()


class RuntimeEndpoint(RemoteBackend):
    """SGLang's `RuntimeEndpoint(base_url)`: a stemma server at an address, HTTP (http://,
    https://) or ZeroMQ (tcp://, ipc://), as a backend: `set_default_backend(RuntimeEndpoint(url))`.
    `api_key` is the server's (`stemma serve --api-key`); `tokenizer` as for RemoteBackend."""

    def __init__(self, base_url: str, api_key: str | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, connect_timeout: float = 30.0):
        if not isinstance(base_url, str):
            raise TypeError(f"RuntimeEndpoint takes a server address, got {type(base_url).__name__}")
        super().__init__(connect(base_url, api_key=api_key, connect_timeout=connect_timeout),
                         tokenizer=tokenizer,
                         connect_timeout=connect_timeout)
        self.base_url = base_url


class EmbeddedBackend(RemoteBackend):
    """A private `stemma.Runtime` (engine and gateway processes) and a client of it."""

    def __init__(self, model: str | None = None, **engine_config: Any):
        from stemma.serve.runtime import Runtime
        self.runtime = Runtime(model, **engine_config)
        super().__init__(self.runtime.client)

    def close(self) -> None:
        self.runtime.close()


def remote_backend_for(value: object) -> RemoteBackend | None:
    """A RemoteBackend for a client, a server address or a stemma.Runtime; None for anything else."""
    if isinstance(value, (Client, str)):
        return RemoteBackend(value)
    http = sys.modules.get("stemma.client.http")  # an HttpClient exists only if its module loaded
    if http is not None and isinstance(value, http.HttpClient):
        return RemoteBackend(value)
    runtime = sys.modules.get("stemma.serve.runtime")  # a Runtime exists only if its module loaded
    if runtime is not None and isinstance(value, runtime.Runtime):
        return RemoteBackend(value.client)
    return None


@functools.lru_cache(maxsize=1)
def embedded_default() -> EmbeddedBackend:
    """The process's embedded runtime on the default model, started on first use and stopped at
    exit (Runtime registers that)."""
    return EmbeddedBackend()
