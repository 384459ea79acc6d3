"""Running a plain (sync) program function as part of an asyncio task.

A program body is ordinary Python: `s += gen("x")` returns at once (the call is queued), and
`s["x"]` must wait for the model. To wait without a thread per program, the body runs in a
greenlet on the event loop's own thread: `await_only(awaitable)` inside it switches back to the
task that started it, which awaits the awaitable and switches back in with the result. So
thousands of program bodies can wait at once on one thread, each inside its own asyncio task.
"""
from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import greenlet

T = TypeVar("T")


class _BodyGreenlet(greenlet.greenlet):
    """The greenlet of one running program body."""


def in_body() -> bool:
    """True inside a program body started by run_body."""
    return isinstance(greenlet.getcurrent(), _BodyGreenlet)


def await_only(awaitable: Awaitable[T]) -> T:
    """Waits for `awaitable` from inside a program body; returns its result or raises its error."""
    current = greenlet.getcurrent()
    if not isinstance(current, _BodyGreenlet):
        raise RuntimeError("await_only is only for code inside a running program body")
    return current.parent.switch(awaitable)


async def run_body(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs `fn(*args, **kwargs)`; each await_only inside it suspends this task, not the thread."""
    child = _BodyGreenlet(fn, parent=greenlet.getcurrent())
    child.gr_context = contextvars.copy_context()
    request = child.switch(*args, **kwargs)
    while not child.dead:
        try:
            result = await request
        except BaseException as exc:  # the awaited call failed (or this task was cancelled):
            request = child.throw(exc)  # it raises inside the body, where the program waited
        else:
            request = child.switch(result)
    return request


def run_now(awaitable: Coroutine[object, None, T]) -> T:
    """Runs a coroutine outside any body and loop, when what it waits for is already there (a
    finished program); raises if it would have to wait."""
    try:
        awaitable.send(None)
    except StopIteration as stop:
        return stop.value
    awaitable.close()
    raise RuntimeError("the program is still running in an event loop; "
                       "`await state.wait_async()` before reading it outside the program")
