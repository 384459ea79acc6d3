"""ProgramState: the `s` a program appends to, and what a run returns.

Inside a running body, reads (`s["x"]`, `s.text()`) wait for the model without blocking the
thread (see suspend.py). After a run they return at once. A state from `f.run(stream=True)` runs
on its own event loop, which iterating `text_iter()` (or any read) drives.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

from stemma.lang.interpreter import Meta, Run, RunConfig, StateExecutor, Value
from stemma.lang.ir import Content, as_node
from stemma.lang.suspend import await_only, in_body, run_body, run_now
from stemma.lang.usage import CallRecord, Usage

T = TypeVar("T")


class ProgramState:
    def __init__(self, executor: StateExecutor, loop: asyncio.AbstractEventLoop | None = None):
        self._ex = executor
        self._task: asyncio.Task | None = None          # the run, while it may still be going
        self._loop = loop                               # the run's own loop (f.run), if any
        self._stream: asyncio.Queue | None = None
        self.return_value: Any = None

    # ---- appending ----
    def __iadd__(self, value: Content) -> "ProgramState":
        for node in as_node(value).flatten():
            self._ex.submit(node)
        return self

    # ---- reading ----
    def _wait(self, awaitable: Awaitable[T]) -> T:
        if in_body():
            return await_only(awaitable)
        if self._loop is not None and not self._loop.is_closed() and not self._loop.is_running():
            return self._loop.run_until_complete(awaitable)
        return run_now(awaitable)

    def __getitem__(self, name: str) -> Value:
        """The value of variable `name`; a join makes it the list of the branches' values."""
        return self._wait(self._ex.get(name))

    def get(self, name: str, default: T | None = None) -> Value | T | None:
        try:
            return self[name]
        except LookupError:
            return default

    def __contains__(self, name: str) -> bool:
        return self.get(name, _MISSING) is not _MISSING

    def text(self) -> str:
        """The whole text so far: appended, generated and selected, with role markup."""
        return self._wait(self._ex.snapshot_text())

    def token_ids(self) -> list[int]:
        """The token ids the next model call would be sent (before any text it appends)."""
        return self._wait(self._ex.token_ids())

    def vars(self) -> dict[str, Value]:
        self._wait(self._ex.idle())
        return dict(self._ex.vars)

    def messages(self) -> list[dict[str, str]]:
        """The closed chat turns: [{'role': 'user', 'content': ...}, ...]."""
        self._wait(self._ex.idle())
        return [dict(m) for m in self._ex.messages]

    def meta(self, name: str) -> Meta:
        """How `name` was made: a RequestOutput for gen (finish_reason, token counts, cached
        tokens), a SelectResult for select (the scores of every choice)."""
        self[name]
        return self._ex.metas[name]

    def calls(self) -> list[CallRecord]:
        """Every request this state sent, with how many prompt tokens came from the cache."""
        self._wait(self._ex.idle())
        return list(self._ex.calls)

    def usage(self) -> Usage:
        """The calls of this state and of the states forked from it, added up."""
        self._wait(self._ex.idle())
        return _usage(self._ex)

    # ---- forks ----
    def fork(self, n: int) -> "ForkGroup":
        """n states that start from this one's text and ids; its prefix is committed to the cache
        once, before they start."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fork needs a count >= 1, got {n!r}")
        return ForkGroup(self, [ProgramState(e, self._loop) for e in self._ex.fork(n)])

    # ---- a run that may still be going ----
    def wait(self) -> "ProgramState":
        """Runs a streamed program to its end (raising its error, if it failed)."""
        if self._task is None:  # a branch: its program's run decides when it ends
            return self
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.run_until_complete(self._task)
            finally:
                close_loop(self._loop)
        elif self._task is not None and not self._task.done():
            raise RuntimeError("this program runs in an event loop: use `await state.wait_async()`")
        return self

    async def wait_async(self) -> "ProgramState":
        if self._task is not None:
            await self._task
        return self

    def _take_stream(self, how: str) -> asyncio.Queue:
        if self._stream is None:
            raise RuntimeError(f"{how} needs a state from a run with stream=True, read once")
        queue, self._stream = self._stream, None
        return queue

    def text_iter(self, generated_only: bool = False) -> Iterator[str]:
        """Text deltas as the program appends and generates them (f.run(stream=True));
        `generated_only` keeps what gen and select add."""
        if self._loop is None:
            raise RuntimeError("text_iter needs a state from f.run(..., stream=True)")
        queue = self._take_stream("text_iter")
        while not self._loop.is_closed():
            item = self._loop.run_until_complete(queue.get())
            if item is None:
                break
            if item[0] or not generated_only:
                yield item[1]
        self.wait()

    async def text_aiter(self, generated_only: bool = False) -> AsyncIterator[str]:
        """The async form of text_iter (f.run_async(..., stream=True))."""
        queue = self._take_stream("text_aiter")
        while True:
            item = await queue.get()
            if item is None:
                break
            if item[0] or not generated_only:
                yield item[1]
        await self.wait_async()

    def cancel(self) -> None:
        """Stops a program that is still running (its requests are aborted)."""
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        if self._loop is not None and not self._loop.is_closed():
            close_loop(self._loop)

    def __repr__(self) -> str:
        names = ", ".join(self._ex.vars)
        return f"<ProgramState vars=[{names}] ids={len(self._ex.ids)}>"


class ForkGroup(Sequence[ProgramState]):
    """The branches of one fork."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState]):
        self.parent = parent
        self.branches = branches

    def __getitem__(self, i):
        return self.branches[i]

    def __len__(self) -> int:
        return len(self.branches)

    def __iadd__(self, value: Content) -> "ForkGroup":
        """Appends the same thing to every branch."""
        for branch in self.branches:
            branch += value
        return self

    def join(self) -> None:
        """Once every branch is done, sets each variable the branches wrote in the parent, as the
        list of the branches' values (None for a branch that did not write it)."""
        self.parent._ex.join([b._ex for b in self.branches])


def start(body: Callable[..., Any], args: tuple, kwargs: dict, config: RunConfig,
          loop: asyncio.AbstractEventLoop, stream: bool, own_loop: bool = False) -> ProgramState:
    """Starts `body(state, *args, **kwargs)` as a task on `loop` and returns its state. `own_loop`:
    the loop is the run's alone (f.run), so reads and streams drive it and wait() closes it."""
    run = Run(config, loop)
    state = ProgramState(run.root(), loop if own_loop else None)
    if stream:
        state._stream = state._ex.listen()

    async def main() -> ProgramState:
        try:
            state.return_value = await run_body(body, state, *args, **kwargs)
            await run.settle()
        finally:
            run.close()
        return state

    state._task = loop.create_task(main())
    return state


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Closes a run's own loop as asyncio.run would: what still runs on it (a client's reader
    tasks, a cancelled program) is cancelled and awaited first."""
    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await loop.shutdown_asyncgens()

    try:
        loop.run_until_complete(cancel_all())
    finally:
        loop.close()


def _usage(executor: StateExecutor) -> Usage:
    total = Usage.of(executor.calls)
    for child in executor.children:
        total = total + _usage(child)
    return total


_MISSING = object()
