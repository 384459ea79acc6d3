"""`@stemma.function`: a program, and the ways to run it.

    @stemma.function
    def qa(s, question):
        s += "Q: " + question + "\\nA:"
        s += stemma.gen("answer", max_new_tokens=32, stop="\\n")

    state = qa.run(question="...", sampling={"temperature": 0})
    states = qa.run_batch([{"question": q} for q in qs], max_concurrency=16, progress_bar=True)

Besides the program's own arguments, the run methods take `backend=` (else the default, see
context.py) and `sampling=` (SamplingParams fields every gen starts from; a gen's own override
them). These names are reserved: a program cannot have parameters called backend or sampling
(nor stream, for run and run_async).
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Mapping, Sequence, TypeAlias

from stemma.lang.backends.base import Backend
from stemma.lang.context import BackendLike, get_backend
from stemma.lang.interpreter import RunConfig
from stemma.lang.state import ProgramState, start
from stemma.lang.tracer import Placeholder, Trace, TracingState, placeholders, trace
from stemma.lang.usage import CallRecord, Usage, total
from stemma.sampling_params import SamplingParams

RESERVED = ("backend", "sampling", "stream")
# a run's sampling defaults: SamplingParams, or some of its fields by name
Sampling: TypeAlias = "SamplingParams | Mapping[str, Any] | None"


class BatchResult(list):
    """The states of a run_batch, in input order, and the prefill of their shared prefix."""

    def __init__(self, states: Sequence[ProgramState], prefix: Trace, prefill: CallRecord | None):
        super().__init__(states)
        self.prefix = prefix
        self.prefill = prefill

    def usage(self) -> Usage:
        """All the batch's calls, the prefix prefill included."""
        return total([Usage.of([self.prefill] if self.prefill else []), *(s.usage() for s in self)])


def _defaults(sampling: Sampling) -> dict[str, Any]:
    """The SamplingParams fields every gen of a run starts from, checked before anything runs."""
    if sampling is None:
        return {}
    checked = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
    if checked.n != 1 or checked.logprob_start is not None:
        raise ValueError("sampling defaults cannot set n or logprob_start: fork for several "
                         "continuations; select scores choices")
    return checked.to_dict() if isinstance(sampling, SamplingParams) else dict(sampling)


class Function:
    def __init__(self, body: Callable[..., Any], name: str | None = None):
        self.body = body
        self.name = name or getattr(body, "__name__", "program")
        self.signature = inspect.signature(body)
        params = list(self.signature.parameters)
        if not params:
            raise TypeError(f"program {self.name}: the first parameter must take the state (s)")
        clash = [p for p in params[1:] if p in RESERVED]
        if clash:
            raise TypeError(f"program {self.name}: parameter name {clash[0]!r} is reserved by run() "
                            f"(reserved: {', '.join(RESERVED)})")

    def __call__(self, s: ProgramState | TracingState, *args: Any, **kwargs: Any) -> Any:
        """Runs the body on a state of a program already running: programs compose."""
        return self.body(s, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<stemma.function {self.name}{self.signature}>"

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
        """Checks the arguments against the signature; errors name the program."""
        try:
            self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"program {self.name}: {exc}") from None
        return tuple(args), dict(kwargs)

    # ---- one program ----
    def run(self, *args: Any, backend: BackendLike | None = None, sampling: Sampling = None,
            stream: bool = False, **kwargs: Any) -> ProgramState:
        """Runs the program to its end and returns its state. With stream=True it returns at once;
        iterate `state.text_iter()` to run it."""
        args, kwargs = self.bind(args, kwargs)
        _not_in_loop(f"{self.name}.run()", f"await {self.name}.run_async()")
        config = RunConfig(get_backend(backend), _defaults(sampling))
        config.backend.codec  # loads the tokenizer (and reaches a remote server) before running
        state = start(self.body, args, kwargs, config, asyncio.new_event_loop(), stream, own_loop=True)
        return state if stream else state.wait()

    async def run_async(self, *args: Any, backend: BackendLike | None = None, sampling: Sampling = None,
                        stream: bool = False, **kwargs: Any) -> ProgramState:
        """run() for asyncio code. With stream=True it returns the state at once; read
        `state.text_aiter()`."""
        args, kwargs = self.bind(args, kwargs)
        config = RunConfig(get_backend(backend), _defaults(sampling))
        state = start(self.body, args, kwargs, config, asyncio.get_running_loop(), stream)
        return state if stream else await state.wait_async()

    # ---- many programs ----
    def placeholders(self) -> dict[str, Placeholder]:
        return placeholders(self.body)

    def trace(self) -> Trace:
        """The constant prefix every run of this program starts with."""
        return trace(self.body, self.placeholders())

    def run_batch(self, batch: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                  backend: BackendLike | None = None, sampling: Sampling = None, max_concurrency: int = 32,
                  progress_bar: bool = False) -> BatchResult:
        """Runs the program once per entry of `batch` (a dict of keyword arguments, or a list of
        positional ones), `max_concurrency` at a time, on one event loop. The traced constant
        prefix is prefilled once first, so every program finds it in the cache."""
        _not_in_loop(f"{self.name}.run_batch()", f"await {self.name}.run_batch_async()")
        backend = get_backend(backend)
        backend.codec
        return asyncio.run(self.run_batch_async(batch, backend=backend, sampling=sampling,
                                                max_concurrency=max_concurrency,
                                                progress_bar=progress_bar))

    async def run_batch_async(self, batch: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                              backend: BackendLike | None = None, sampling: Sampling = None,
                              max_concurrency: int = 32,
                              progress_bar: bool = False) -> BatchResult:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        bound = [self.bind((), item) if isinstance(item, Mapping) else self.bind(item, {})
                 for item in batch]
        config = RunConfig(get_backend(backend), _defaults(sampling))
        prefix = self.trace()
        prefill = await _prefill(config.backend, prefix)
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(max_concurrency)
        bar = _progress(len(bound), self.name) if progress_bar else None

        async def one(args: tuple, kwargs: dict) -> ProgramState:
            async with gate:
                state = start(self.body, args, kwargs, config, loop, stream=False)
                await state.wait_async()
            if bar is not None:
                bar.update(1)
            return state

        tasks = [loop.create_task(one(a, k)) for a, k in bound]
        try:
            states = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        return BatchResult(states, prefix, prefill)


async def _prefill(backend: Backend, prefix: Trace) -> CallRecord | None:
    text = prefix.render(backend.chat_template)
    if not text:
        return None
    ids = list(backend.codec.start_ids) + backend.codec.encode(text)
    return CallRecord.of("prefill", None, (await backend.prefill(ids)).meta)


def _progress(total_count: int, name: str):
    from tqdm.auto import tqdm
    return tqdm(total=total_count, desc=name, unit="program")


def _not_in_loop(what: str, instead: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what} was called inside a running event loop; use `{instead}`")


def function(body: Callable[..., Any] | None = None, *, name: str | None = None):
    """Decorator: `@stemma.function` or `@stemma.function(name=...)`."""
    if body is None:
        return lambda fn: Function(fn, name)
    return Function(body, name)
