"""Where program bodies run: plain (sync) bodies on worker threads, async bodies on the loop.

All model traffic stays on one asyncio event loop: every state's task, every backend call, the
mock's and the engine's bookkeeping. Only the program body, the user's own Python, moves:

    def body(s)        runs on a worker thread. `s += ...` posts the node to the loop and
                       returns; a read (`s["x"]`) posts a coroutine to the loop and blocks this
                       thread until it is done. So a blocking call in the
                       body (time.sleep, an HTTP request, a database query) blocks that program
                       alone: the loop, and every other program, keep going.
    async def body(s)  runs on the loop, in a greenlet: its `await`s go to the loop as in any
                       coroutine (`await asyncio.sleep(0.5)` pauses this program only), and a sync
                       read (`s["x"]`) switches out of the greenlet to the program's task, which
                       awaits the value and switches back in. No thread at all.

Why not greenlets for every body, as before: a greenlet runs on the loop's own thread, so one
blocking call in one body stalled the loop, and with it every other program (eight bodies each
sleeping 0.5 s took 4 s). A greenlet cannot move to another thread once it turns out to block,
and whether a body will block cannot be known before it runs. So a sync body gets a thread of its
own, as in SGLang; a read costs a round trip between two threads (tens of microseconds, next to
milliseconds per model call; on the mock backend, with no model time at all, a batch of 2000
programs of five reads each takes about 1.5x as long as with greenlets). The greenlet keeps its place for async bodies: it is what lets the
sync read `s["x"]` wait inside a coroutine without blocking the loop; bodies written `async def`
are the path without threads, for thousands of programs waiting at once.

Order: everything a body's thread sends to the loop (appends, forks, joins, reads) goes through
the loop's inbox (post()), which runs calls in the order they were posted, so a read always comes
after the appends before it, as when the body ran on the loop. One call_soon_threadsafe wakes the
loop for every call posted before it has run them.

Threads: each event loop has a pool. At most `limit` bodies (and sync tool calls of async
bodies, see tool.py) run on its threads at once; the others wait on the loop, taking no thread.
`limit` is DEFAULT_THREADS (SGLang's num_threads="auto") unless reserve_threads() raised it, as
run_batch does for a max_concurrency above it. Threads start on demand and are reused while the
loop has calls on threads; when none is left they are stopped and joined, so a finished run (or
run_batch) leaves no thread behind. A thread still busy then (a cancelled body inside a blocking
call: a thread cannot be interrupted) finishes that call, its result is dropped, and it stops.

Cancelling a program (state.cancel(), a failed batch) raises asyncio.CancelledError in its body
where it waits for the model (a BaseException: `except Exception` in a body does not swallow it).
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import queue
import threading
import weakref
from collections import deque
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import greenlet

T = TypeVar("T")

DEFAULT_THREADS = max(96, 16 * (os.cpu_count() or 1))  # SGLang's num_threads="auto"
IDLE_S = 5.0  # a thread left idle this long (not stopped with the others) stops on its own


class Body:
    """One running program body: the loop its model traffic runs on, and the reads it waits for."""

    def __init__(self, loop: asyncio.AbstractEventLoop, owner: Any = None):
        self.loop = loop
        self.owner = owner      # the body's first argument, its ProgramState (tool.py reads it)
        self.cancelled = False
        self._lock = threading.Lock()
        self._waiting: set[_Waiter] = set()      # the body's reads in flight
        self._tasks: set[asyncio.Task] = set()   # their tasks (on the loop)

    def wait(self, awaitable: Awaitable[T]) -> T:
        """From a thread that is not the loop's: runs `awaitable` on the loop, blocks until it is
        done, and returns its result or raises its error."""
        waiter = _Waiter()
        with self._lock:  # registered before it is posted: a cancel now fails it, run or not
            if self.cancelled:
                _close(awaitable)
                raise asyncio.CancelledError()
            self._waiting.add(waiter)
        try:
            post(self.loop, self._start, awaitable, waiter)
        except RuntimeError:  # the loop is closed: the program is over
            _close(awaitable)
            waiter.set(None, asyncio.CancelledError())
        try:
            return waiter.get()
        finally:
            with self._lock:
                self._waiting.discard(waiter)

    # ---- on the loop ----
    def _start(self, awaitable: Awaitable[Any], waiter: "_Waiter") -> None:
        if self.cancelled:
            _close(awaitable)
            return  # (cancel() failed the waiter)
        task = asyncio.ensure_future(awaitable, loop=self.loop)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._finish(done, waiter))

    def _finish(self, task: asyncio.Task, waiter: "_Waiter") -> None:
        self._tasks.discard(task)
        if task.cancelled():
            waiter.set(None, asyncio.CancelledError())
        elif task.exception() is not None:
            waiter.set(None, task.exception())
        else:
            waiter.set(task.result())

    def cancel(self) -> None:
        """The program is cancelled: every read of the body fails with CancelledError, now and
        from now on."""
        with self._lock:
            self.cancelled = True
            waiting = list(self._waiting)
        for waiter in waiting:
            waiter.set(None, asyncio.CancelledError())
        for task in list(self._tasks):
            task.cancel()


_SET_LOCK = threading.Lock()


class _Waiter:
    """What a body's thread blocks on: one result, set once (a bare lock: cheaper than a
    concurrent.futures.Future's condition)."""
    __slots__ = ("_lock", "_done", "_result", "_error")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def set(self, result: Any, error: BaseException | None = None) -> None:
        with _SET_LOCK:  # a finish (on the loop) and a cancel may both come
            if self._done:
                return
            self._done, self._result, self._error = True, result, error
        self._lock.release()

    def get(self) -> Any:
        self._lock.acquire()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result


def _close(awaitable: Awaitable[Any]) -> None:
    if inspect.iscoroutine(awaitable):
        awaitable.close()  # never started: no "coroutine was never awaited" warning


_BODY: contextvars.ContextVar[Body | None] = contextvars.ContextVar("stemma_body", default=None)


class _BodyGreenlet(greenlet.greenlet):
    """The greenlet of one running async program body."""


def current_body() -> Body | None:
    """The body of the program this code runs for (in its body, or in a tool it called)."""
    return _BODY.get()


def in_greenlet_body() -> bool:
    """True in an async body, on the loop: a sync call there may wait by switching out."""
    return isinstance(greenlet.getcurrent(), _BodyGreenlet)


def in_thread_body() -> bool:
    """True on a thread that runs for a program (a sync body, a tool it called) and may block
    until the loop has done something: any thread but the one running the program's loop."""
    body = _BODY.get()
    return body is not None and asyncio._get_running_loop() is not body.loop


def in_body() -> bool:
    """True inside a program body started by run_body (or a tool it called): reads may wait."""
    return in_greenlet_body() or in_thread_body()


def await_only(awaitable: Awaitable[T]) -> T:
    """Waits for `awaitable` from inside a program body; returns its result or raises its error.
    In an async body it switches out to the program's task; on a body's thread it blocks that
    thread while the loop runs the awaitable."""
    current = greenlet.getcurrent()
    if isinstance(current, _BodyGreenlet):
        return current.parent.switch(awaitable)
    body = _BODY.get()
    if body is not None and asyncio._get_running_loop() is not body.loop:
        return body.wait(awaitable)
    _close(awaitable)
    raise RuntimeError("await_only is only for code inside a running program body")


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Calls `fn(*args)` on `loop`: now when this code runs on it (or outside any program while the
    loop is not running: after a run), else from the loop's inbox, in the order posted."""
    if asyncio._get_running_loop() is not loop and (_BODY.get() is not None or loop.is_running()):
        _inbox(loop).post(fn, args)
    else:
        fn(*args)


class _Inbox:
    """Calls posted to a loop from other threads, run in order, each in its poster's context. One
    call_soon_threadsafe (a write to the loop's self-pipe) wakes the loop for all the calls that
    arrive before it has run them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # (a strong one would keep the loop alive: _INBOXES)
        self.lock = threading.Lock()
        self.calls: deque[tuple[contextvars.Context, Callable[..., Any], tuple]] = deque()
        self.scheduled = False
        self.posted = 0  # calls posted so far

    def post(self, fn: Callable[..., Any], args: tuple) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            raise RuntimeError("Event loop is closed")
        context = contextvars.copy_context()  # the poster's: a task started there inherits it
        with self.lock:
            self.calls.append((context, fn, args))
            self.posted += 1
            if self.scheduled:
                return
            self.scheduled = True
        try:
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # closed
            with self.lock:
                self.calls.clear()
                self.scheduled = False
            raise

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.calls:
                    self.scheduled = False
                    return
                calls, self.calls = self.calls, deque()
            for context, fn, args in calls:
                try:
                    context.run(fn, *args)
                except BaseException as exc:  # (the calls posted here do not raise)
                    asyncio.get_running_loop().call_exception_handler(
                        {"message": f"stemma: posted call {fn!r} failed", "exception": exc})


def posted(loop: asyncio.AbstractEventLoop) -> int:
    """How many calls other threads have posted to `loop` so far (program bodies' turns)."""
    inbox = _INBOXES.get(loop)
    return 0 if inbox is None else inbox.posted


_INBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox]" = \
    weakref.WeakKeyDictionary()
_INBOX_LOCK = threading.Lock()


def _inbox(loop: asyncio.AbstractEventLoop) -> _Inbox:
    inbox = _INBOXES.get(loop)
    if inbox is None:
        with _INBOX_LOCK:
            inbox = _INBOXES.get(loop)
            if inbox is None:
                inbox = _INBOXES[loop] = _Inbox(loop)
    return inbox


# ---- running a body ----
async def run_body(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs the program body `fn(state, *args, **kwargs)` to its end, as the module docstring
    says: a sync body on a worker thread, an async one on this loop, in a greenlet."""
    body = Body(asyncio.get_running_loop(), args[0] if args else None)
    context = contextvars.copy_context()
    context.run(_BODY.set, body)
    if inspect.iscoroutinefunction(fn):
        return await _in_greenlet(context, _step_through, context.run(fn, *args, **kwargs))
    try:
        result = await in_thread(fn, args, kwargs, context)
    except asyncio.CancelledError:
        body.cancel()
        raise
    if inspect.iscoroutine(result):  # a plain callable that returned a coroutine: an async body
        return await _in_greenlet(context, _step_through, result)
    return result


async def in_thread(fn: Callable[..., T], args: tuple = (), kwargs: dict | None = None,
                    context: contextvars.Context | None = None) -> T:
    """Runs `fn(*args, **kwargs)` on a thread of this loop's pool (in `context`, else a copy of
    the current one) and waits for it without blocking the loop."""
    loop = asyncio.get_running_loop()
    pool = _pool(loop)
    context = context if context is not None else contextvars.copy_context()
    async with pool.gate:
        future = loop.create_future()
        pool.active += 1
        try:
            pool.submit(_Job(context, fn, args, kwargs or {}, loop, future))
            return await future
        finally:
            pool.active -= 1
            if pool.active == 0:
                pool.stop_idle()


def reserve_threads(loop: asyncio.AbstractEventLoop, n: int) -> None:
    """Lets at least `n` bodies of `loop` run on threads at once (run_batch: max_concurrency)."""
    pool = _pool(loop)
    for _ in range(n - pool.limit):
        pool.gate.release()
    pool.limit = max(pool.limit, n)


# ---- async bodies ----
async def _in_greenlet(context: contextvars.Context, fn: Callable[..., T], *args: Any) -> T:
    """Runs `fn(*args)` in a greenlet; each await_only inside it suspends this task, not the
    thread."""
    child = _BodyGreenlet(fn, parent=greenlet.getcurrent())
    child.gr_context = context
    request = child.switch(*args)
    while not child.dead:
        try:
            result = await request
        except BaseException as exc:  # the awaited call failed (or this task was cancelled):
            request = child.throw(exc)  # it raises inside the body, where the program waited
        else:
            request = child.switch(result)
    return request


def _step_through(coro: Coroutine[Any, Any, T]) -> T:
    """Runs an async body inside its greenlet, one step at a time: what a step yields (a future
    it awaits) is awaited by the program's task through await_only, so the body's own sync calls
    (a read, a tool) can switch out of the greenlet between its awaits too."""
    error: BaseException | None = None
    while True:
        try:
            yielded = coro.send(None) if error is None else coro.throw(error)
        except StopIteration as stop:
            return stop.value
        try:
            error = None
            await_only(_resume(yielded))
        except BaseException as exc:  # the task was cancelled: the body gets it where it waits
            error = exc


async def _resume(yielded: Any) -> None:
    """Waits, in the program's task, for what one step of an async body yielded, as the task
    would have: a bare yield is one turn of the loop; a future, its end (the body then reads the
    outcome itself, as `await future` does)."""
    if yielded is None:
        await asyncio.sleep(0)
        return
    if not asyncio.isfuture(yielded):
        raise RuntimeError(f"a program body awaited something asyncio cannot wait for: {yielded!r}")
    yielded._asyncio_future_blocking = False
    try:
        await yielded
    except BaseException as exc:
        if yielded.done() and (yielded.cancelled() if isinstance(exc, asyncio.CancelledError)
                               else yielded.exception() is exc):
            return  # the future's own outcome: the body raises it when it resumes
        raise       # this task was cancelled: thrown into the body


# ---- the threads ----
class _Job:
    def __init__(self, context: contextvars.Context, fn: Callable[..., Any], args: tuple,
                 kwargs: dict, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.context, self.fn, self.args, self.kwargs = context, fn, args, kwargs
        self.loop, self.future = loop, future

    def run(self) -> Callable[[], None]:
        """Runs the call; returns what hands its outcome to the loop."""
        try:
            result, error = self.context.run(self.fn, *self.args, **self.kwargs), None
        except BaseException as exc:
            result, error = None, exc
        del self.context, self.fn, self.args, self.kwargs

        def deliver() -> None:
            try:
                self.loop.call_soon_threadsafe(_resolve, self.future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits for this any more
                pass
        return deliver


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled while the thread ran
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _Worker:
    def __init__(self, pool: "_Pool", job: _Job):
        self.pool = pool
        self.inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.inbox.put(job)
        self.thread = threading.Thread(target=self._work, name="stemma-body", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        pool = self.pool
        while True:
            try:
                job = self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with pool.lock:
                    if self in pool.idle:  # nobody handed this thread a job meanwhile: stop
                        pool.idle.remove(self)
                        return
                job = self.inbox.get()  # one is on its way
            if job is None:
                return
            deliver = job.run()
            with pool.lock:
                late = pool.active == 0  # its caller gave up on it (cancelled): nothing is left
                if not late:             # idle before the outcome is out, so that stop_idle(),
                    pool.idle.append(self)  # when the loop has it, finds this thread
            deliver()
            if late:
                return
            del job, deliver


class _Gate:
    """asyncio.Semaphore without its reference to the loop (which _POOLS must not hold)."""

    def __init__(self, free: int):
        self.free = free
        self.waiters: deque[asyncio.Future] = deque()

    async def __aenter__(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # it was handed the slot as it was cancelled: pass it on
            raise
        finally:
            if future in self.waiters:
                self.waiters.remove(future)

    async def __aexit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> None:
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                future.set_result(None)  # the slot goes straight to the first waiter
                return
        self.free += 1


class _Pool:
    """The body threads of one event loop."""

    def __init__(self, limit: int):
        self.limit = limit
        self.gate = _Gate(limit)
        self.active = 0                   # calls on threads or about to be (the loop's count)
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []     # workers waiting for a job

    def submit(self, job: _Job) -> None:
        with self.lock:
            worker = self.idle.pop() if self.idle else None
        if worker is not None:
            worker.inbox.put(job)
        else:
            _Worker(self, job)

    def stop_idle(self) -> None:
        """Stops and joins the idle workers (from the loop, when nothing runs on a thread)."""
        with self.lock:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.inbox.put(None)
        for worker in idle:
            worker.thread.join()


_POOLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool]" = \
    weakref.WeakKeyDictionary()


def _pool(loop: asyncio.AbstractEventLoop) -> _Pool:
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = _Pool(DEFAULT_THREADS)
    return pool


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
