"""ProgramState: the `s` a program appends to, and what a run returns.

Inside a running body, reads (`s["x"]`, `s.text()`) wait for the model (see suspend.py). After a run they return at once. A state from `f.run(stream=True)` runs
on its own event loop, which iterating `text_iter()` (or any read) drives.

SGLang's state API is here too: role scopes (`with s.user(): ...`), `s.var_scope(name)`,
`s[name] = value`, `sync()`, `text_iter(var_name)`, and on a fork group `forks += lambda i: ...`,
`forks[i] += ...` and `join(mode="concate_and_append")`. Some of them wait, in the body, for
what the state was given before them to be executed, so the body does not run ahead there:
  - var_scope, at its start and its end: the variable is the text appended in between;
  - `s[name] = value`, so that it lands after what came before it;
  - join(mode="concate_and_append"): it needs the branches' text;
  - in a streamed run (stream=True), each gen and select of the root state: a mark goes into the
    stream before its text, which is how text_iter(var_name) finds where a variable's text starts.
The root's calls run one after another anyway; only the body's running ahead (to queue what
comes after) is given up there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

from stemma.lang.errors import ProgramError, VariableNotGenerated
from stemma.lang.interpreter import Meta, Run, RunConfig, StateExecutor, Value
from stemma.lang.ir import Content, Gen, Node, Select, as_node
from stemma.lang.roles import RoleMethods
from stemma.lang.scoring import SelectResult
from stemma.lang.suspend import await_only, in_body, run_body, run_now
from stemma.lang.usage import CallRecord, Usage
from stemma.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")

JOIN_MODES = ("gather_variable", "concate_and_append")  # SGLang's names (sic: "concate")


@dataclass(frozen=True)
class _Mark:
    """In a streamed state's queue, before the text of a variable: `kind` "var" (a gen or select;
    it ends at the next mark or at appended text), "begin" / "end" (a var_scope)."""
    kind: str
    name: str | None


class _Follow:
    """Reads one variable's deltas out of a stream: feed items in order; each gives (delta to
    yield or None, finished, give the item back for the next reader)."""

    def __init__(self, name: str):
        self.name = name
        self.found = False
        self.scope = False

    def feed(self, item: Any) -> tuple[str | None, bool, bool]:
        if isinstance(item, _Mark):
            if not self.found:
                if item.name == self.name and item.kind in ("var", "begin"):
                    self.found, self.scope = True, item.kind == "begin"
                return None, False, False
            if self.scope:
                return None, item.kind == "end" and item.name == self.name, False
            return None, True, True            # the next gen or select: this one has ended
        generated, delta = item
        if not self.found:
            return None, False, False
        if self.scope or generated:
            return delta, False, False
        return None, True, True                # text appended after it: it has ended


class ProgramState(RoleMethods):
    def __init__(self, executor: StateExecutor, loop: asyncio.AbstractEventLoop | None = None):
        self._ex = executor
        self._task: asyncio.Task | None = None          # the run, while it may still be going
        self._loop = loop                               # the run's own loop (f.run), if any
        self._stream: asyncio.Queue | None = None       # stream=True: what the run appends
        self._held: deque = deque()                     # stream items read ahead, given back
        self._seen: set[str | None] = set()             # variables whose marks were read
        self._submitted = 0                             # nodes appended (a fork, a gather: none)
        self._cancelled = False                         # cancel() stopped the run before its end
        self.return_value: Any = None

    # ---- appending ----
    def __iadd__(self, value: Content) -> "ProgramState":
        for node in as_node(value).flatten():
            if self._stream is not None and isinstance(node, (Gen, Select)) and in_body():
                self._mark("var", node.name)
            self._ex.submit(node)
            self._submitted += 1
        return self

    def _mark(self, kind: str, name: str | None) -> None:
        """Puts a mark in the stream once everything before it has been executed."""
        self._wait(self._marked(kind, name))

    # These run on the run's loop (the body may be on a thread of its own, see suspend.py), each
    # once what the state was given before has been executed.
    async def _marked(self, kind: str, name: str | None) -> int:
        await self._ex.idle()
        if self._stream is not None:
            self._stream.put_nowait(_Mark(kind, name))
        return len(self._ex.text)

    async def _scoped(self, name: str, start: int) -> None:
        await self._ex.idle()
        self._ex._set(name, self._ex.text[start:], None)
        if self._stream is not None:
            self._stream.put_nowait(_Mark("end", name))

    async def _assigned(self, name: str, value: Any) -> None:
        await self._ex.idle()
        self._ex._set(name, value, None)

    # ---- roles (RoleMethods) and scopes (SGLang's state methods) ----

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope("x"): ...`: variable x is all the text the block appends (text,
        generated, selected, role markup). It waits for what came before at its start, and for
        what the block appended at its end."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"var_scope: a variable name must be an identifier, got {name!r}")
        start = self._wait(self._marked("begin", name))
        yield
        self._wait(self._scoped(name, start))

    # ---- reading ----
    def _wait(self, awaitable: Awaitable[T]) -> T:
        if in_body():
            return await_only(awaitable)
        if self._cancelled:  # nothing will run again: what it would wait for never comes
            awaitable.close()
            raise ProgramError("this program run was cancelled before it finished (a text_iter left "
                               "early, or cancel()): text(), vars() and its variables hold what it had")
        if self._loop is not None and not self._loop.is_closed() and not self._loop.is_running():
            return self._loop.run_until_complete(awaitable)
        return run_now(awaitable)

    def __getitem__(self, name: str) -> Value:
        """The value of variable `name`; a join makes it the list of the branches' values."""
        if self._so_far():
            if name not in self._ex.vars:
                raise VariableNotGenerated(name, list(self._ex.vars))
            return self._ex.vars[name]
        return self._wait(self._value(name, outside=not in_body()))

    def _so_far(self) -> bool:
        """Whether a read takes what the state has now: its run was cancelled (read from outside)."""
        return self._cancelled and not in_body()

    def _idle(self) -> None:
        """Waits until what the state was given has been executed (not for a cancelled run)."""
        if not self._so_far():
            self._wait(self._ex.idle())

    async def _value(self, name: str, outside: bool) -> Value:
        try:
            return await self._ex.get(name)
        except VariableNotGenerated:
            # a streamed run's body runs as its text is read, so it may not have reached the gen
            # of `name` yet: read from outside the body, the variable waits for the run's end
            # (its text stays queued for text_iter), as SGLang's reads wait for the variable
            if (not outside or self._stream is None or self._loop is None or self._task is None
                    or self._task.done()):  # (_loop: f.run's own, which this read drives)
                raise
        await asyncio.wait({self._task})
        if self._task.cancelled():
            raise ProgramError("this program run was cancelled before it finished")
        if self._task.exception() is not None:  # the body's own error (its executors are closed)
            raise self._task.exception()
        return await self._ex.get(name)

    def __setitem__(self, name: str, value: Any) -> None:
        """Sets variable `name` (SGLang's `s[name] = value`, `set_var`), once what the state was
        given before has been executed; its meta is None."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a variable name must be a non-empty string, got {name!r}")
        self._wait(self._assigned(name, value))

    def get_var(self, name: str) -> Value:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any] | Meta:
        """SGLang's name for meta(): a gen's as a dict (prompt_tokens, cached_tokens,
        completion_tokens, finish_reason, ...; with return_logprob, SGLang's
        output_token_logprobs and output_top_logprobs: (logprob, token id, None) tuples, the
        text left None as SGLang leaves it without return_text_in_logprobs), a select's as
        SGLang's too (SelectResult.sglang_meta_info; meta() gives the SelectResult)."""
        meta = self.meta(name)
        if isinstance(meta, SelectResult):
            return meta.sglang_meta_info()
        if not isinstance(meta, RequestOutput):
            return meta
        info = {**meta.meta, "finish_reason": meta.finish_reason}
        if meta.logprobs is not None:
            info["output_token_logprobs"] = [(lp, t, None) for t, lp in zip(meta.token_ids, meta.logprobs)]
        if meta.top_logprobs is not None:
            info["output_top_logprobs"] = [[(lp, t, None) for t, lp in pos] for pos in meta.top_logprobs]
        return info

    def get(self, name: str, default: T | None = None) -> Value | T | None:
        try:
            return self[name]
        except LookupError:
            return default

    def __contains__(self, name: str) -> bool:
        return self.get(name, _MISSING) is not _MISSING

    def text(self) -> str:
        """The whole text so far: appended, generated and selected, with role markup."""
        if self._so_far():
            return self._ex.text
        return self._wait(self._ex.snapshot_text())

    def token_ids(self) -> list[int]:
        """The token ids the next model call would be sent (before any text it appends)."""
        return self._wait(self._ex.token_ids())

    def vars(self) -> dict[str, Value]:
        self._idle()
        return dict(self._ex.vars)

    def messages(self) -> list[dict[str, str]]:
        """The closed chat turns: [{'role': 'user', 'content': ...}, ...]."""
        self._idle()
        return [dict(m) for m in self._ex.messages]

    def meta(self, name: str) -> Meta:
        """How `name` was made: a RequestOutput for gen (finish_reason, token counts, cached
        tokens), a SelectResult for select (the scores of every choice)."""
        self[name]
        return self._ex.metas[name]

    def calls(self) -> list[CallRecord]:
        """Every request this state sent, with how many prompt tokens came from the cache."""
        self._idle()
        return list(self._ex.calls)

    def usage(self) -> Usage:
        """The calls of this state and of the states forked from it, added up."""
        self._idle()
        return _usage(self._ex)

    # ---- forks ----
    def fork(self, n: int = 1, *, size: int | None = None) -> "ForkGroup":
        """n states that start from this one's text and ids; its prefix is committed to the cache
        once, before they start. (`size`: SGLang's name for n.)"""
        if size is not None:
            n = size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"fork needs a count >= 1, got {n!r}")
        branches = [ProgramState(e, self._loop) for e in self._ex.fork(n)]
        return ForkGroup(self, branches)

    @contextmanager
    def copy(self) -> Iterator["ProgramState"]:
        """`with s.copy() as c: ...`: a fork of one, joined (its variables gathered) at the end."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

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

    def sync(self) -> "ProgramState":
        """SGLang's sync(): waits until everything the state was given has been executed (in a
        body), or runs the program to its end (a state from a run, streamed or not)."""
        if in_body():
            self._wait(self._ex.idle())
            return self
        return self.wait()

    def error(self) -> BaseException | None:
        """The error the program stopped with, or None (SGLang's error())."""
        try:
            self.sync()
        except Exception as exc:
            return exc
        task = self._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            return task.exception()  # a run_batch program whose model call failed
        return self._ex.error

    def failed_executing(self, exc: BaseException) -> bool:
        """Whether `exc`, which the program stopped with, is what stopped the execution of its
        state or a fork's (a model call that failed, ...), not an error raised by its body."""
        return any(executor.error is exc for executor in self._ex.run.executors)

    # ---- streaming ----
    def _read(self) -> Any:
        """The next stream item (a (generated, delta) pair, a _Mark, or None at the end)."""
        if self._held:
            return self._held.popleft()
        if self._loop is None or self._loop.is_closed():  # the run is over: what it left
            try:
                return self._stream.get_nowait()
            except asyncio.QueueEmpty:
                return None
        return self._loop.run_until_complete(self._stream.get())

    async def _aread(self) -> Any:
        if self._held:
            return self._held.popleft()
        return await self._stream.get()

    def _give_back(self, item: Any) -> None:
        self._held.appendleft(item)

    def text_iter(self, var_name: str | None = None, generated_only: bool = False) -> Iterator[str]:
        """Text deltas as the program appends and generates them (f.run(stream=True)).

        `var_name`: only that variable's deltas (a gen's or select's, or a var_scope's), as they
        are generated. The iteration ends after the variable, once the program has run to its
        end (so no body is left waiting); what it appended after the variable stays queued, so
        `text_iter("a")` then `text_iter("b")` give a's deltas, then b's (b's at once).
        Without it, everything, to the program's end; `generated_only` keeps what gen and select
        add. A state from a run without stream=True gives the whole text (or the variable) at
        once, as SGLang does.

        Leaving the iteration before its end (a `break`) cancels a run still going: its requests
        are aborted and its program ends (the program is driven by its reader, so it would
        otherwise hold its requests, unread, until the state is waited on)."""
        deltas = self._text_iter(var_name, generated_only)
        try:
            yield from deltas
        except GeneratorExit:
            self.cancel()
            raise

    def _text_iter(self, var_name: str | None, generated_only: bool) -> Iterator[str]:
        if isinstance(var_name, bool):  # stemma's text_iter(generated_only) before var_name came
            var_name, generated_only = None, var_name
        if self._stream is None:
            yield self.text() if var_name is None else self[var_name]
            return
        if self._loop is None:
            raise RuntimeError("this state streams in a running event loop: iterate "
                               "`state.text_aiter()` (async for)")
        if var_name is None:
            while (item := self._read()) is not None:
                if _shown(item, generated_only, self._seen):
                    yield item[1]
            self._held.append(None)
            self.wait()
            return
        if var_name not in self._seen:
            follow = _Follow(var_name)
            while (item := self._read()) is not None:
                delta, finished, give_back = follow.feed(item)
                _saw(item, give_back, self._seen)
                if delta:
                    yield delta
                if finished:
                    if give_back:
                        self._give_back(item)
                    break
            else:
                self._held.append(None)
            if follow.found:
                self.wait()  # the rest of the program runs; its text stays queued
                return
        self.wait()
        yield self[var_name]  # gone by before this iteration (or never streamed): at once

    async def text_aiter(self, var_name: str | None = None,
                         generated_only: bool = False) -> AsyncIterator[str]:
        """The async form of text_iter (f.run_async(..., stream=True)); leaving it early cancels
        the run too (once the generator is closed: at once with `aclose()`, else when collected)."""
        deltas = self._text_aiter(var_name, generated_only)
        try:
            async for delta in deltas:
                yield delta
        except GeneratorExit:
            self.cancel()
            raise
        finally:
            await deltas.aclose()

    async def _text_aiter(self, var_name: str | None, generated_only: bool) -> AsyncIterator[str]:
        if isinstance(var_name, bool):
            var_name, generated_only = None, var_name
        if self._stream is None:
            await self.wait_async()
            yield self.text() if var_name is None else self[var_name]
            return
        if var_name is None:
            while (item := await self._aread()) is not None:
                if _shown(item, generated_only, self._seen):
                    yield item[1]
            self._held.append(None)
            await self.wait_async()
            return
        if var_name not in self._seen:
            follow = _Follow(var_name)
            while (item := await self._aread()) is not None:
                delta, finished, give_back = follow.feed(item)
                _saw(item, give_back, self._seen)
                if delta:
                    yield delta
                if finished:
                    if give_back:
                        self._give_back(item)
                    break
            else:
                self._held.append(None)
            if follow.found:
                await self.wait_async()
                return
        await self.wait_async()
        yield self[var_name]

    def text_async_iter(self, var_name: str | None = None,
                        return_meta_data: bool = False) -> AsyncIterator[str]:
        """SGLang's name for text_aiter."""
        if return_meta_data:
            raise NotImplementedError("text_async_iter(return_meta_data=True) is not supported: "
                                      "read state.get_meta_info(name) once the variable is done")
        return self.text_aiter(var_name)

    def cancel(self) -> None:
        """Stops a program that is still running (its requests are aborted)."""
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        self._cancelled = True
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
        self._parent_at = parent._submitted  # what the parent had been given at the fork

    @property
    def states(self) -> list[ProgramState]:
        """SGLang's name for the branches."""
        return self.branches

    def __getitem__(self, i):
        return self.branches[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """What `forks[i] += ...` stores back: branch i itself (it cannot be replaced)."""
        if value is not self.branches[i]:
            raise TypeError("a fork's branch cannot be replaced; `forks[i] += ...` appends to it")

    def __len__(self) -> int:
        return len(self.branches)

    def __iadd__(self, value: Content | Sequence[Content] | Callable[[int], Content]) -> "ForkGroup":
        """Appends to every branch: the same text or expression; `lambda i: ...`, what it returns
        for branch i; a list, its i-th item to branch i."""
        if callable(value) and not isinstance(value, Node):
            for i, branch in enumerate(self.branches):
                branch += value(i)
        elif isinstance(value, (list, tuple)):
            if len(value) != len(self.branches):
                raise ValueError(f"appending a list to a fork of {len(self.branches)} needs one item "
                                 f"per branch, got {len(value)}")
            for branch, item in zip(self.branches, value):
                branch += item
        else:
            for branch in self.branches:
                branch += value
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """`gather_variable` (the default): once every branch is done, sets each variable the
        branches wrote in the parent, as the list of the branches' values (None for a branch that
        did not write it). `concate_and_append`: appends the text each branch added after the
        fork to the parent, branch after branch; the parent must not have been appended to since
        the fork. Its prefix is in the cache already (the fork committed it), and the parent's
        next call sends the branches' text as its own."""
        if mode == "gather_variable":
            self.parent._ex.join([b._ex for b in self.branches])
        elif mode == "concate_and_append":
            self._concatenate()
        else:
            raise ValueError(f"join mode must be one of {', '.join(JOIN_MODES)}, got {mode!r}")

    def _concatenate(self) -> None:
        parent = self.parent
        if parent._submitted != self._parent_at:
            raise ProgramError("join(mode='concate_and_append') appends the branches' text where "
                               "they forked, so the parent cannot be appended to between the fork "
                               "and this join; append after the join")
        parent += parent._wait(self._branch_texts())

    async def _branch_texts(self) -> str:
        """On the loop: what the branches appended after the fork, once they are done."""
        for branch in self.branches:
            await branch._ex.idle()
        await self.parent._ex.idle()
        base = self.parent._ex.text
        parts = []
        for branch in self.branches:
            text = branch._ex.text
            if not text.startswith(base):
                raise ProgramError("a branch's text does not start with its parent's; was the "
                                   "parent appended to after the fork?")
            parts.append(text[len(base):])
        return "".join(parts)


def _saw(item: Any, given_back: bool, seen: set[str | None]) -> None:
    """Notes a mark read for good: its variable's text has gone by."""
    if isinstance(item, _Mark) and not given_back:
        seen.add(item.name)


def _shown(item: Any, generated_only: bool, seen: set[str | None]) -> bool:
    """Whether text_iter() yields `item` (marks are only noted)."""
    if isinstance(item, _Mark):
        seen.add(item.name)
        return False
    return item[0] or not generated_only


def start(body: Callable[..., Any], args: tuple, kwargs: dict, config: RunConfig,
          loop: asyncio.AbstractEventLoop, stream: bool, own_loop: bool = False) -> ProgramState:
    """Starts `body(state, *args, **kwargs)` as a task on `loop` and returns its state. `own_loop`:
    the loop is the run's alone (f.run), so reads and streams drive it and wait() closes it."""
    run = Run(dataclasses.replace(config, backend=config.backend.for_one_run()), loop)
    state = ProgramState(run.root(), loop if own_loop else None)
    if stream:
        state._stream = state._ex.listen()

    async def main() -> ProgramState:
        try:
            state.return_value = await run_body(body, state, *args, **kwargs)
            await run.settle()
        finally:
            run.close()
            await _end_program(run)
        return state

    state._task = loop.create_task(main())
    return state


async def _end_program(run: Run) -> None:
    """Tells the backend the program ended; a failure to (the server gone) is not the program's."""
    try:
        await run.end()
    except Exception:  # the program's own outcome stands; the server's records time out
        logger.debug("could not tell the backend that program %s ended", run.program_id, exc_info=True)


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
