"""`stemma.tool`: marks a function a program calls out to (an HTTP API, a database, a search
index, a calculator) as a tool call.

    @stemma.tool
    def search(query: str) -> str:
        return requests.get(URL, params={"q": query}).text    # blocks: fine

    @stemma.function
    def agent(s, question):
        s += question + stemma.gen("query", stop="\\n")
        s += "Result: " + search(s["query"]) + "\\n"         # this program pauses; others run on
        s += stemma.gen("answer")

A tool call does two things:

- It runs off the event loop. In a plain (sync) body, which runs on its own worker thread
  (suspend.py), it simply runs there: any blocking call in a body already blocks only that body,
  tool or not. In an `async def` body, which runs on the loop, a sync tool goes to a worker
  thread of the loop's pool while the body waits (it is still called like a plain function:
  `search(q)`, no await). An `async def` tool runs on the loop: await it in an async body
  (`await lookup(q)`); called from a sync body it returns its result (the body's thread waits).
- It records a pause hint on the program's run: a ToolCall (name, started, ended, failed, times
  from time.monotonic()) appended to `Run.tool_calls` when the call starts and closed when it
  ends; `Run.in_tool()` lists the calls still running. While a program is in a tool call it
  sends the model nothing (unless it forked), which a program-aware scheduler can use, e.g. to
  keep the program's prefix cached and its slot free until about when the call should return.
  Nothing reads the hints yet. Blocking calls not marked as tools work the same, without a hint.

Outside any program a tool is just its function (nothing is recorded). While run_batch traces a
body for its constant prefix (tracer.py, inside `tracing()`), a tool call ends the trace instead
of running. On the loop's own thread but outside a body's greenlet (in a task an async body
started), a sync tool runs where it is called, blocking the loop: there, await an async tool or
`asyncio.to_thread` instead.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, TypeVar, overload

from stemma.lang import suspend

if TYPE_CHECKING:
    from stemma.lang.interpreter import Run

F = TypeVar("F", bound=Callable[..., Any])


@overload
def tool(fn: F, *, name: str | None = None) -> F: ...
@overload
def tool(fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None):
    """Decorator (`@stemma.tool`, `@stemma.tool(name="search")`) or wrapper
    (`stemma.tool(requests.get)(url)`): calls of the result are tool calls (module docstring).
    `name` labels its pause hints (default: the function's name)."""
    if fn is None:
        return functools.partial(tool, name=name)
    if not callable(fn):
        raise TypeError(f"stemma.tool wraps a function, got {type(fn).__name__}")
    label = name or getattr(fn, "__name__", None) or type(fn).__name__
    wrapper = _async_tool(fn, label) if inspect.iscoroutinefunction(fn) else _sync_tool(fn, label)
    functools.update_wrapper(wrapper, fn)
    wrapper.__stemma_tool__ = label
    return wrapper


_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("stemma_tracing", default=False)


@contextmanager
def tracing() -> Iterator[None]:
    """While tracer.trace runs a body for its constant prefix: a tool call there ends the trace
    (StopTracing) instead of running the tool (a side effect, or seconds of waiting)."""
    token = _TRACING.set(True)
    try:
        yield
    finally:
        _TRACING.reset(token)


def _not_tracing(label: str) -> None:
    if _TRACING.get():
        from stemma.lang.tracer import StopTracing  # (here: tracer.py imports this module)
        raise StopTracing(f"tool {label!r} is called")


def _sync_tool(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        _not_tracing(label)
        with _pause(label):
            if suspend.in_greenlet_body():  # an async body, on the loop: run it on a thread
                context = contextvars.copy_context()  # the body's, so reads work in the tool too
                return suspend.await_only(suspend.in_thread(fn, args, kwargs, context))
            return fn(*args, **kwargs)
    return call


def _async_tool(fn: Callable[..., Awaitable[Any]], label: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        _not_tracing(label)
        run = _current_run()
        coro = _paused(run, label, fn(*args, **kwargs))
        if suspend.in_thread_body():  # a sync body's thread: run it on the loop and wait
            return suspend.await_only(coro)
        return coro
    return call


def _current_run() -> "Run | None":
    """The run of the program whose body (or tool) this code runs in, if any."""
    body = suspend.current_body()
    executor = getattr(getattr(body, "owner", None), "_ex", None)  # its ProgramState's executor
    return getattr(executor, "run", None)


@contextmanager
def _pause(label: str) -> Iterator[None]:
    run = _current_run()
    if run is None:
        yield
        return
    call = run.tool_started(label)
    failed = True
    try:
        yield
        failed = False
    finally:
        run.tool_ended(call, failed)


async def _paused(run: "Run | None", label: str, awaitable: Awaitable[Any]) -> Any:
    if run is None:
        return await awaitable
    call = run.tool_started(label)
    failed = True
    try:
        result = await awaitable
        failed = False
        return result
    finally:
        run.tool_ended(call, failed)
