"""The asyncio interpreter: one task per program state executes that state's nodes in order.

    body (thread/greenlet) ── s += node ──▶ StateExecutor.queue ──▶ task: execute ──▶ backend
                           ◀─ s["x"] waits ─┘ (await_only)

`s += ...` only queues, so a body runs ahead of the model and a fork's branches all get their
calls in flight at once; reading a variable waits for the nodes that write it. All of this runs
on the run's event loop; a body on a worker thread (suspend.py) reaches it through the body-side
methods (submit, fork, join), which post to the loop in order (Run.post). A state keeps the token
ids of everything already sent (see codec.py): each call's prompt is those ids plus the text
appended since, tokenized once. A fork first commits its parent's prompt to the cache (a request
that generates nothing), then every branch starts from those ids.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
import uuid
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, TypeAlias

from stemma.lang.backends.base import CURRENT_CALL, Backend
from stemma.lang.errors import GenerationFailed, RoleError, UnknownVariable, VariableNotGenerated
from stemma.lang.ir import Gen, Node, RoleBegin, RoleEnd, Select, Text, VarRef, sets_variable
from stemma.lang.scoring import decide
from stemma.lang.suspend import post
from stemma.lang.usage import CallRecord
from stemma.program_call import MAX_PAUSE_S, ProgramCall
from stemma.sampling_params import SamplingParams

if TYPE_CHECKING:
    from stemma.lang.scoring import SelectResult
    from stemma.outputs import RequestOutput

Value: TypeAlias = "str | list[Value | None]"  # gen's text, select's choice; a join: each branch's
Meta: TypeAlias = "RequestOutput | SelectResult | None"  # how a variable was made; None after a join

_SCORE = dict(max_new_tokens=0)


@dataclass(frozen=True)
class RunConfig:
    backend: Backend
    defaults: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams fields for every gen


@dataclass(frozen=True)
class Snapshot:
    """What a branch inherits from its parent at the fork."""
    ids: tuple[int, ...]
    text: str
    vars: Mapping[str, Value]
    metas: Mapping[str, Meta]
    messages: tuple[Mapping[str, str], ...]
    role: str | None
    role_start: int
    fork_call: int | None = None  # the parent's last model call before the fork


@dataclass(frozen=True, eq=False)
class ForkPoint(Node):
    """Internal: where a parent hands its prefix to its branches."""
    future: asyncio.Future


@dataclass(frozen=True, eq=False)
class JoinPoint(Node):
    """Internal: gathers the branches' variables into the parent."""
    branches: tuple["StateExecutor", ...]
    names: tuple[str, ...]


class Pulse:
    """Wakes every coroutine waiting for a state to change."""

    def __init__(self):
        self._waiters: list[asyncio.Future] = []

    async def wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        finally:
            if future in self._waiters:
                self._waiters.remove(future)

    def fire(self) -> None:
        for future in self._waiters:
            if not future.done():
                future.set_result(None)
        self._waiters.clear()


@dataclass(eq=False)
class ToolCall:
    """One stemma.tool call of a program (tool.py): a pause of the program, not a model call.
    Times are time.monotonic(); `ended` is None while the call runs."""
    name: str
    started: float
    ended: float | None = None
    failed: bool = False

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class Run:
    """The live states of one program run, on one event loop."""

    def __init__(self, config: RunConfig, loop: asyncio.AbstractEventLoop):
        self.config = config
        self.loop = loop
        self.executors: list[StateExecutor] = []
        # the pause hints: every stemma.tool call of the program, in the order they started.
        # Written by the body's thread (list appends, attribute sets), read on the loop.
        self.tool_calls: list[ToolCall] = []
        # the program context each model call carries (stemma.program_call)
        self.program_id = uuid.uuid4().hex
        self.calls_made = 0          # also the index of the next call

    def root(self) -> "StateExecutor":
        start = Snapshot(tuple(self.config.backend.codec.start_ids), "", {}, {}, (), None, 0)
        return self.spawn(start)

    def spawn(self, origin: Snapshot | asyncio.Future) -> "StateExecutor":
        executor = StateExecutor(self, origin)
        self.executors.append(executor)
        return executor

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Calls `fn(*args)` on the loop: now from the loop's own thread, else in order."""
        post(self.loop, fn, *args)

    # ---- the program context of model calls ----
    @contextmanager
    def call(self, fork_parent: int | None) -> Iterator[int]:
        """Around one model call (its requests): they carry this program's context, a new call
        index (yielded), and the pause the program's finished tool calls took on average."""
        index = self.calls_made
        self.calls_made += 1
        token = CURRENT_CALL.set(ProgramCall(self.program_id, index, fork_parent, True, self.pause_hint()))
        try:
            yield index
        finally:
            CURRENT_CALL.reset(token)

    def pause_hint(self) -> float | None:
        """The mean of the program's finished tool calls, in seconds (at most what a ProgramCall
        takes); None before any."""
        done = [c.seconds for c in self.tool_calls if c.seconds is not None]
        return min(statistics.fmean(done), MAX_PAUSE_S) if done else None

    async def end(self) -> None:
        """Tells the backend that the program calls no more (when it made any call)."""
        if self.calls_made:
            await self.config.backend.end_program(self.program_id)

    # ---- pause hints ----
    def tool_started(self, name: str) -> ToolCall:
        call = ToolCall(name, time.monotonic())
        self.tool_calls.append(call)
        return call

    def tool_ended(self, call: ToolCall, failed: bool = False) -> None:
        call.failed = failed
        call.ended = time.monotonic()

    def in_tool(self) -> list[ToolCall]:
        """The tool calls running now: while there is one, the program is paused in it (since
        the earliest `started`), and sends the model nothing unless it forked."""
        return [call for call in self.tool_calls if call.ended is None]

    async def settle(self) -> None:
        """Waits until every state has executed all it was given; raises the first failure."""
        while True:
            pending = [e for e in self.executors if e.busy]
            for executor in self.executors:
                if executor.error is not None:
                    raise executor.error
            if not pending:
                return
            await pending[0].idle()

    def close(self) -> None:
        for executor in self.executors:
            executor.close()


class StateExecutor:
    def __init__(self, run: Run, origin: Snapshot | asyncio.Future | None):
        """`origin`: where the state starts; None for a fork's branch made on a body's thread,
        which the loop starts (_begin) when it reaches the fork."""
        self.run = run
        self.backend = run.config.backend
        self.codec = self.backend.codec
        self.ids: list[int] = []
        self.pending = ""            # text appended since the last call, not yet tokenized
        self.text = ""
        self.vars: dict[str, Value] = {}
        self.metas: dict[str, Meta] = {}
        self.own: list[str] = []     # variables this state wrote (not inherited at a fork)
        self.messages: list[dict[str, str]] = []
        self.role: str | None = None
        self.role_start = 0
        self.calls: list[CallRecord] = []
        self.children: list[StateExecutor] = []
        self.last_call: int | None = None  # the index of this state's latest model call
        self.fork_parent: int | None = None  # a branch: the parent's last call before the fork
        self.listeners: list[asyncio.Queue] = []
        self.error: BaseException | None = None
        self.busy = 1                # nodes queued or running, plus the wait for the origin
        self.started = False         # the origin (a fork's snapshot) has been restored
        self._expected: Counter[str] = Counter()  # variables that queued nodes will write
        self._queue: deque[Node] = deque()
        self._changed = Pulse()
        self._has_work = asyncio.Event()
        self._closed = False
        self.task: asyncio.Task | None = None
        if origin is not None:
            self._begin(origin)

    def _begin(self, origin: Snapshot | asyncio.Future) -> None:
        self.task = self.run.loop.create_task(self._main(origin))

    # ---- the body's side (any thread) ----
    def submit(self, node: Node) -> None:
        self._check_open()
        self.run.post(self._enqueue, node)

    def _check_open(self) -> None:
        if self.error is not None:
            raise self.error
        if self._closed:
            raise RuntimeError("this program state has finished running; it cannot take more nodes")

    def fork(self, n: int) -> list["StateExecutor"]:
        self._check_open()
        branches = [StateExecutor(self.run, None) for _ in range(n)]
        self.run.post(self._fork_now, branches)
        return branches

    def join(self, branches: list["StateExecutor"]) -> None:
        self._check_open()
        self.run.post(self._join_now, branches)

    # ---- the same, on the loop ----
    def _enqueue(self, node: Node) -> bool:
        """Queues `node`; False when this state has failed or finished (a body on a thread may
        have sent it just then: its next read, or the run's end, raises the error)."""
        if self.error is not None or self._closed:
            return False
        name = sets_variable(node)
        if name is not None:
            self._expected[name] += 1
        if isinstance(node, JoinPoint):
            self._expected.update(node.names)
        self._queue.append(node)
        self.busy += 1
        self._has_work.set()
        return True

    def _fork_now(self, branches: list["StateExecutor"]) -> None:
        future = self.run.loop.create_future()
        if not self._enqueue(ForkPoint(future)):
            future.set_exception(self.error or RuntimeError("the program state has finished"))
        for branch in branches:
            branch._begin(future)
        self.run.executors.extend(branches)
        self.children.extend(branches)

    def _join_now(self, branches: list["StateExecutor"]) -> None:
        names: list[str] = []
        for branch in branches:
            for name in [*branch.own, *branch._expected]:
                if name not in names and (name in branch.own or branch._expected[name] > 0):
                    names.append(name)
        self._enqueue(JoinPoint(tuple(branches), tuple(names)))

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.error is not None:
                raise self.error
            await self._changed.wait()

    async def idle(self) -> None:
        await self._until(lambda: self.busy == 0 or self.error is not None)
        if self.error is not None:
            raise self.error

    async def get(self, name: str) -> Value:
        await self._until(lambda: self.started and self._expected[name] == 0)
        if self.error is not None:
            raise self.error
        if name not in self.vars:
            raise VariableNotGenerated(name, list(self.vars), [n for n, c in self._expected.items() if c > 0])
        return self.vars[name]

    async def snapshot_text(self) -> str:
        await self.idle()
        return self.text

    async def token_ids(self) -> list[int]:
        await self.idle()
        return self.flush()

    # ---- the task ----
    async def _main(self, origin: Snapshot | asyncio.Future) -> None:
        try:
            self._restore(await origin if isinstance(origin, asyncio.Future) else origin)
            self.started = True
            self._done_one()
            while True:
                while not self._queue:
                    self._has_work.clear()
                    await self._has_work.wait()
                node = self._queue.popleft()
                await self._execute(node)
                name = sets_variable(node)
                if name is not None:
                    self._expected[name] -= 1
                if isinstance(node, JoinPoint):
                    self._expected.subtract(node.names)
                self._done_one()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the state stops; whoever waits on it gets the error
            self.error = exc
            for node in self._queue:
                if isinstance(node, ForkPoint) and not node.future.done():
                    node.future.set_exception(exc)
            self._changed.fire()
            self._end_streams()

    def _done_one(self) -> None:
        self.busy -= 1
        self._changed.fire()

    def close(self) -> None:
        self._closed = True
        if self.task is not None:
            self.task.cancel()
        self._end_streams()

    # ---- streaming ----
    def listen(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.listeners.append(queue)
        return queue

    def _emit(self, delta: str, generated: bool = False) -> None:
        for queue in self.listeners:
            queue.put_nowait((generated, delta))

    def _emit_generated(self, delta: str) -> None:
        self._emit(delta, generated=True)

    def _end_streams(self) -> None:
        for queue in self.listeners:
            queue.put_nowait(None)
        self.listeners.clear()

    # ---- state ----
    def _restore(self, snap: Snapshot) -> None:
        self.ids = list(snap.ids)
        self.text = snap.text
        self.vars = dict(snap.vars)
        self.metas = dict(snap.metas)
        self.messages = [dict(m) for m in snap.messages]
        self.role = snap.role
        self.role_start = snap.role_start
        self.fork_parent = self.last_call = snap.fork_call

    def snapshot(self) -> Snapshot:
        return Snapshot(tuple(self.flush()), self.text, dict(self.vars), dict(self.metas),
                        tuple(dict(m) for m in self.messages), self.role, self.role_start,
                        self.last_call)

    def flush(self) -> list[int]:
        """The ids of everything so far: the pending text is tokenized now, once."""
        if self.pending:
            self.ids.extend(self.codec.encode(self.pending))
            self.pending = ""
        return list(self.ids)

    def _append_text(self, text: str) -> None:
        self.pending += text
        self.text += text
        self._emit(text)

    def _append_generated(self, text: str, ids: list[int], streamed: bool) -> None:
        self.flush()
        self.ids.extend(ids)
        self.text += text
        if not streamed:
            self._emit(text, generated=True)

    def _set(self, name: str | None, value: Value, meta: Meta) -> None:
        if name is not None:
            self.vars[name] = value
            self.metas[name] = meta
            if name not in self.own:
                self.own.append(name)

    def _record(self, kind: str, name: str | None, meta: Mapping[str, Any]) -> None:
        self.calls.append(CallRecord.of(kind, name, dict(meta)))

    def _prompt(self, what: str) -> list[int]:
        ids = self.flush()
        if not ids:
            raise ValueError(f"{what}: the program is empty, and this model has no BOS token to "
                             f"start from; append some text first")
        return ids

    # ---- nodes ----
    async def _execute(self, node: Node) -> None:
        if isinstance(node, Text):
            self._append_text(node.value)
        elif isinstance(node, VarRef):
            if node.name not in self.vars:
                raise UnknownVariable(node.name, node.where, list(self.vars))
            self._append_text(str(self.vars[node.name]))
        elif isinstance(node, RoleBegin):
            self._begin_role(node.role)
        elif isinstance(node, RoleEnd):
            self._end_role(node.role)
        elif isinstance(node, Gen):
            await self._gen(node)
        elif isinstance(node, Select):
            await self._select(node)
        elif isinstance(node, ForkPoint):
            await self._fork(node)
        elif isinstance(node, JoinPoint):
            await self._join(node)
        else:
            raise TypeError(f"the interpreter cannot execute {type(node).__name__}")

    def _begin_role(self, role: str) -> None:
        if self.role is not None:
            raise RoleError(f"cannot open a {role} turn inside the open {self.role} turn; "
                            f"close it first")
        self._append_text(self.backend.chat_template.prefix(role))
        self.role, self.role_start = role, len(self.text)

    def _end_role(self, role: str) -> None:
        if self.role != role:
            raise RoleError(f"{role}_end closes no open {role} turn (open: {self.role or 'none'})")
        # the turn's text without its leading whitespace, as SGLang's messages hold it
        self.messages.append({"role": role, "content": self.text[self.role_start:].lstrip()})
        self.role = None
        self._append_text(self.backend.chat_template.suffix(role))

    @contextmanager
    def _call(self) -> Iterator[None]:
        """One model call of this state, in its program's context (Run.call)."""
        with self.run.call(self.fork_parent) as index:
            self.last_call = index
            yield

    def _gen_params(self, node: Gen) -> SamplingParams:
        params = SamplingParams.from_dict({**self.run.config.defaults, **node.overrides})
        template = self.backend.chat_template
        if self.role == "assistant" and (template.stop or template.stop_ids):
            params = params.replace(stop=[*params.stop, *template.stop],
                                    stop_token_ids=[*params.stop_token_ids, *template.stop_ids])
        return params

    async def _gen(self, node: Gen) -> None:
        params = self._gen_params(node)
        ids = self._prompt(f"gen {node.name!r}")
        on_text = self._emit_generated if self.listeners else None
        with self._call():
            out = await self.backend.generate(ids, params, on_text)
        _check("gen", node.name, out)
        # a stop may have left text out: a stop string, a stop token, or an EOS that is a plain
        # token (a generation_config's) the settle cannot tell by its id
        trimmed = out.finish_reason == "stop"
        dropped = () if params.include_stop_str_in_output else params.stop_token_ids  # not in the text
        kept = self.codec.settle(out.token_ids, out.text, trimmed, dropped, ids)
        self._append_generated(out.text, kept, streamed=on_text is not None)
        self._set(node.name, out.text, out)
        self._record("gen", node.name, out.meta)

    async def _select(self, node: Select) -> None:
        prefix = self._prompt(f"select {node.name!r}")
        choice_ids = [self.codec.encode(c) for c in node.choices]
        with self._call():
            self._record("prefill", node.name, (await self.backend.prefill(prefix)).meta)
        at = len(prefix)
        requests = [(prefix + ids, SamplingParams(**_SCORE, logprob_start=at)) for ids in choice_ids]
        if node.method == "unconditional_likelihood_normalized":
            context = list(self.codec.start_ids) or prefix[-1:]
            requests += [(context + ids, SamplingParams(**_SCORE, logprob_start=len(context)))
                         for ids in choice_ids]
        with self._call():
            outs = await self.backend.generate_batch(requests)
        for out in outs:
            self._record("select", node.name, out.meta)
            _check("select", node.name, out)
        logprobs = [list(out.prompt_logprobs) for out in outs]
        n = len(choice_ids)
        result = dataclasses.replace(decide(node.method, node.choices, logprobs[:n], logprobs[n:] or None),
                                     token_ids=tuple(tuple(ids) for ids in choice_ids))
        self._append_generated(result.choice, choice_ids[result.index], streamed=False)
        self._set(node.name, result.choice, result)

    async def _fork(self, node: ForkPoint) -> None:
        prefix = self.flush()
        if len(prefix) > len(self.codec.start_ids):
            with self._call():
                self._record("prefill", None, (await self.backend.prefill(prefix)).meta)
        node.future.set_result(self.snapshot())

    async def _join(self, node: JoinPoint) -> None:
        for branch in node.branches:
            await branch.idle()
        for name in node.names:  # None for a branch that did not write it (not its inherited value)
            values = [branch.vars[name] if name in branch.own else None for branch in node.branches]
            self._set(name, values, None)


def _check(what: str, name: str | None, out: RequestOutput) -> None:
    """A call the server ended in error fails the program (its text is no value to read)."""
    if out.finish_reason == "error":
        raise GenerationFailed(what, name, str(out.meta.get("error") or "the request failed"), out)
