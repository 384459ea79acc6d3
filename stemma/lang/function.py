"""`@stemma.function`: a program, and the ways to run it.

    @stemma.function
    def qa(s, question):
        s += "Q: " + question + "\\nA:"
        s += stemma.gen("answer", max_new_tokens=32, stop="\\n")

    state = qa.run(question="...", temperature=0)          # or sampling={"temperature": 0}
    state = qa(question="...", temperature=0)              # a direct call runs it too (SGLang)
    states = qa.run_batch([{"question": q} for q in qs], max_concurrency=16, progress_bar=True)

Besides the program's own arguments, the run methods take `backend=` (else the default, see
context.py) and the sampling options every gen starts from (a gen's own override them): as
keyword arguments, as SGLang takes them (max_new_tokens, temperature, stop, ...; options.py
lists the names), and/or as `sampling=` (a SamplingParams or a dict of its fields). A keyword
argument is the program's when the body has a parameter of that name, else a sampling option
when it names one. A name that is both is the program's (as on SGLang, whose run() passes on
every name but its own), unless SGLang's run() takes it as its own keyword (RUN_KEYWORDS:
temperature, stop, max_new_tokens, ...): that is an error, and the program's argument goes
positionally (or the option in sampling=). backend, sampling and stream are reserved: a program cannot have
parameters called so.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Mapping, Sequence, TypeAlias

from stemma.lang.backends.base import Backend
from stemma.lang.context import BackendLike, get_backend
from stemma.lang.interpreter import RunConfig
from stemma.lang.options import RUN_KEYWORDS, is_option, normalize
from stemma.lang.state import ProgramState, start
from stemma.lang.suspend import reserve_threads
from stemma.lang.tracer import Placeholder, Trace, TracingState, placeholders, trace
from stemma.lang.usage import CallRecord, Usage, total
from stemma.sampling_params import SamplingParams

DEFAULT_CONCURRENCY = 32

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


def _defaults(sampling: Sampling, options: Mapping[str, Any] | None = None,
              where: str = "run") -> dict[str, Any]:
    """The SamplingParams fields every gen of a run starts from: `sampling`, and the keyword
    `options` (SGLang's names too), checked before anything runs."""
    extra = normalize(options or {}, where)
    if sampling is None:
        merged = extra
    elif isinstance(sampling, SamplingParams):
        merged = {**sampling.to_dict(), **extra}
    else:
        if not isinstance(sampling, Mapping):
            raise ValueError(f"{where}: sampling must be a SamplingParams or a dict of its fields, "
                             f"got {type(sampling).__name__}")
        base = normalize(sampling, where)
        twice = sorted(set(base) & set(extra))
        if twice:
            raise ValueError(f"{where}: {twice[0]} is given twice, in sampling= and as a keyword "
                             f"argument; give it once")
        merged = {**base, **extra}
    if not merged:
        return {}
    checked = SamplingParams.from_dict(merged)
    if checked.n != 1 or checked.logprob_start is not None:
        raise ValueError("sampling defaults cannot set n or logprob_start: fork for several "
                         "continuations; select scores choices")
    return merged


def _concurrency(max_concurrency: int | None, num_threads: int | str | None) -> int:
    """run_batch's concurrency: max_concurrency, or SGLang's num_threads ("auto": the default)."""
    if num_threads in (None, "auto"):
        count = DEFAULT_CONCURRENCY if max_concurrency is None else max_concurrency
    else:
        if not isinstance(num_threads, int) or isinstance(num_threads, bool):
            raise ValueError(f"num_threads must be an int or 'auto', got {num_threads!r}")
        if max_concurrency is not None and max_concurrency != num_threads:
            raise ValueError("num_threads (SGLang's name) and max_concurrency are the same option: "
                             "how many programs run at once; give one")
        count = num_threads
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {count!r}")
    return count


class Function:
    def __init__(self, body: Callable[..., Any], name: str | None = None,
                 num_api_spec_tokens: int | None = None):
        """`num_api_spec_tokens` (SGLang's API speculative execution): on a backend whose server
        keeps no prefix between calls (OpenAIBackend), a gen asks for at least this many tokens,
        and the gens that follow are served from what it generated while the program's text
        matches it (see backends/speculative.py). Stemma's own backends reuse the prefix cache
        instead, and run the program exactly as without it."""
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
        if num_api_spec_tokens is not None and (not isinstance(num_api_spec_tokens, int) or
                                                isinstance(num_api_spec_tokens, bool) or
                                                num_api_spec_tokens < 1):
            raise ValueError(f"program {self.name}: num_api_spec_tokens must be an int >= 1, got "
                             f"{num_api_spec_tokens!r}")
        self.num_api_spec_tokens = num_api_spec_tokens

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`f(s, ...)` on a running program's state runs the body on it (programs compose);
        `f(...)` with the program's arguments runs the program, as `f.run(...)` (SGLang)."""
        if args and isinstance(args[0], (ProgramState, TracingState)):
            return self.body(*args, **kwargs)
        return self.run(*args, **kwargs)

    def parameter_names(self) -> frozenset[str]:
        """The names a caller can pass the program's arguments by."""
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return frozenset(p.name for p in list(self.signature.parameters.values())[1:]
                         if p.kind in named)

    def split(self, kwargs: Mapping[str, Any], what: str = "run") -> tuple[dict, dict]:
        """(the program's keyword arguments, the sampling options) of a run's keyword arguments."""
        names = self.parameter_names()
        program, options = {}, {}
        for key, value in kwargs.items():
            if not is_option(key) or (key in names and key not in RUN_KEYWORDS):
                program[key] = value
            elif key in names:
                raise TypeError(f"program {self.name}: {key!r} is both a parameter of the program "
                                f"and a sampling option of {what}(); pass the program's argument "
                                f"positionally, or the option as sampling={{{key!r}: ...}}")
            else:
                options[key] = value
        return program, options

    def _config(self, backend: BackendLike | None, sampling: Sampling,
                options: Mapping[str, Any], what: str) -> RunConfig:
        chosen = get_backend(backend)
        defaults = _defaults(sampling, options, f"{self.name}.{what}()")
        if self.num_api_spec_tokens is not None and not chosen.reuses_prefix:
            from stemma.lang.backends.speculative import SpeculativeBackend
            chosen = SpeculativeBackend(chosen, self.num_api_spec_tokens)
        return RunConfig(chosen, defaults)

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
        iterate `state.text_iter()` to run it. `kwargs`: the program's arguments and the run's
        sampling options (see the module's docstring)."""
        kwargs, options = self.split(kwargs)
        args, kwargs = self.bind(args, kwargs)
        _not_in_loop(f"{self.name}.run()", f"await {self.name}.run_async()")
        config = self._config(backend, sampling, options, "run")
        config.backend.codec  # loads the tokenizer (and reaches a remote server) before running
        state = start(self.body, args, kwargs, config, asyncio.new_event_loop(), stream, own_loop=True)
        return state if stream else state.wait()

    async def run_async(self, *args: Any, backend: BackendLike | None = None, sampling: Sampling = None,
                        stream: bool = False, **kwargs: Any) -> ProgramState:
        """run() for asyncio code. With stream=True it returns the state at once; read
        `state.text_aiter()`."""
        kwargs, options = self.split(kwargs, "run_async")
        args, kwargs = self.bind(args, kwargs)
        config = self._config(backend, sampling, options, "run_async")
        state = start(self.body, args, kwargs, config, asyncio.get_running_loop(), stream)
        return state if stream else await state.wait_async()

    # ---- many programs ----
    def placeholders(self) -> dict[str, Placeholder]:
        return placeholders(self.body)

    def trace(self) -> Trace:
        """The constant prefix every run of this program starts with."""
        return trace(self.body, self.placeholders())

    def run_batch(self, batch: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                  backend: BackendLike | None = None, sampling: Sampling = None,
                  max_concurrency: int | None = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, **options: Any) -> BatchResult:
        """Runs the program once per entry of `batch` (a dict of keyword arguments, or a list of
        positional ones), `max_concurrency` (SGLang: `num_threads`; default 32) at a time, on one
        event loop. The traced constant prefix is prefilled once first, so every program finds
        it in the cache. `options`: the sampling options of every program (temperature=...).
        Every state comes back: one whose model call failed (a prompt past the context, the
        server gone) has it as `error()`, as in SGLang; an exception of a body ends the batch."""
        _not_in_loop(f"{self.name}.run_batch()", f"await {self.name}.run_batch_async()")
        self._check_options(options, "run_batch")
        backend = get_backend(backend)
        backend.codec
        return asyncio.run(self.run_batch_async(batch, backend=backend, sampling=sampling,
                                                max_concurrency=max_concurrency,
                                                num_threads=num_threads,
                                                progress_bar=progress_bar, **options))

    def _check_options(self, options: Mapping[str, Any], what: str) -> None:
        for key in options:
            if not is_option(key):
                raise TypeError(f"{self.name}.{what}() got an unexpected keyword argument {key!r}: "
                                f"not a sampling option (the programs' arguments go in the batch)")

    async def run_batch_async(self, batch: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                              backend: BackendLike | None = None, sampling: Sampling = None,
                              max_concurrency: int | None = None, num_threads: int | str = "auto",
                              progress_bar: bool = False, **options: Any) -> BatchResult:
        max_concurrency = _concurrency(max_concurrency, num_threads)
        self._check_options(options, "run_batch_async")
        bound = [self.bind((), item) if isinstance(item, Mapping) else self.bind(item, {})
                 for item in batch]
        config = self._config(backend, sampling, options, "run_batch")
        prefix = self.trace()
        prefill = await _prefill(config.backend, prefix) if bound else None
        loop = asyncio.get_running_loop()
        reserve_threads(loop, max_concurrency)  # bodies that block (in tools) take a thread each
        gate = asyncio.Semaphore(max_concurrency)
        bar = _progress(len(bound), self.name) if progress_bar else None

        async def one(args: tuple, kwargs: dict) -> ProgramState:
            async with gate:
                state = start(self.body, args, kwargs, config, loop, stream=False)
                try:
                    await state.wait_async()
                except Exception as exc:  # as SGLang: a failed call is the state's error()
                    if not state.failed_executing(exc):
                        raise  # the body's own error ends the batch
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


def function(body: Callable[..., Any] | None = None, *, name: str | None = None,
             num_api_spec_tokens: int | None = None):
    """Decorator: `@stemma.function`, or `@stemma.function(name=..., num_api_spec_tokens=...)`."""
    if body is None:
        return lambda fn: Function(fn, name, num_api_spec_tokens)
    return Function(body, name, num_api_spec_tokens)
