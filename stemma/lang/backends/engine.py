"""A backend over an in-process `stemma.Engine`, driven from the event loop.

Requests are submitted to the engine as they come; one driver task per event loop steps the
engine while any request is pending, and yields to the loop between steps so that programs can
submit their next calls. Everything programs submit in one turn of the loop lands in the same
engine step: that is how a select's choices, or a batch's programs, are batched.

The step runs on the loop, so a program body on its thread is served between steps: its reads of
the state (`s["x"]`, `get_meta_info`) and its next calls each wait for the step under way. After a
step that finished a program's call while other requests still run, the loop serves the turns
that result wakes (the body reads its result, starts a tool or submits its next call) before it
starts the next step, for as long as the bodies keep posting turns (SETTLE_SLICE_S apart, at most
SETTLE_S in all); a program that ends with its call posts nothing, and costs one slice. The steps
stay on the loop rather than on a thread of their own: on a CPU, the bodies' turns would then run
beside the matmuls (README, Programs).

Programs run on other threads (f.run() from a thread pool: each run has its own loop) share the
engine: every engine call holds the engine's lock, each loop's driver steps it while that loop
has requests (a step serves every loop's), and publishes only its own loop's.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from stemma.lang.backends.base import CURRENT_CALL, Backend, OnText
from stemma.lang.codec import HFCodec, TokenCodec
from stemma.lang.suspend import posted
from stemma.outputs import RequestOutput
from stemma.sampling_params import SamplingParams
from stemma.text.publisher import Publisher

if TYPE_CHECKING:
    from stemma.engine.engine import Engine
    from stemma.engine.request import Request

logger = logging.getLogger(__name__)

SETTLE_SLICE_S = 0.002
SETTLE_S = 0.01


async def _settle() -> None:
    """Serves program bodies' turns on this loop while they keep coming (module docstring)."""
    loop = asyncio.get_running_loop()
    end = time.perf_counter() + SETTLE_S
    seen = -1
    while time.perf_counter() < end and posted(loop) != seen:
        seen = posted(loop)
        await asyncio.sleep(SETTLE_SLICE_S)


def _retrieved(task: asyncio.Task) -> None:
    """Marks what ended a driver as seen: it handles every Exception itself, and an interrupt
    (Ctrl-C during a step) went up through the loop already; asyncio printed it again at exit."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Waiter:
    req: Request
    future: asyncio.Future
    on_text: OnText | None = None
    published: Publisher | None = None  # with a text stream, when on_text is set


# one lock per engine, shared by every backend over it: programs on other threads (each run's
# own event loop) call into the same engine, which is not thread-safe
_ENGINE_LOCKS: "weakref.WeakKeyDictionary[Engine, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_of(engine: Engine) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _ENGINE_LOCKS.get(engine)
        if lock is None:
            lock = _ENGINE_LOCKS[engine] = threading.RLock()
        return lock


class EngineBackend(Backend):
    """Invariants: every engine call holds the engine's lock; `_waiting[loop]` holds the requests
    submitted from `loop` and not yet published, and only `loop`'s driver publishes them (their
    futures are that loop's); a loop's driver runs while it has waiters, stepping the engine for
    every loop's requests."""

    def __init__(self, engine: Engine | None = None, **engine_config: Any):
        """`engine`: a stemma.Engine; None starts one from `engine_config` (EngineConfig fields)."""
        if engine is None:
            from stemma.engine.engine import Engine
            engine = Engine(**engine_config)
        elif engine_config:
            raise ValueError("pass an engine or engine options, not both")
        self.engine = engine
        self._lock = _lock_of(engine)
        self._codec = HFCodec(engine.tokenizer)
        self._waiting: dict[asyncio.AbstractEventLoop, dict[str, _Waiter]] = {}
        self._drivers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}

    @property
    def codec(self) -> TokenCodec:
        return self._codec

    def _submit(self, ids: list[int], params: SamplingParams, on_text: OnText | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._drop_closed_loops()
            (req,) = self.engine.submit(ids, params, call=CURRENT_CALL.get())
            waiter = _Waiter(req, loop.create_future(), on_text)
            if on_text is not None:
                waiter.published = Publisher(self.engine.text_stream(req))
            self._waiting.setdefault(loop, {})[req.rid] = waiter
        driver = self._drivers.get(loop)
        if driver is None or driver.done():
            driver = self._drivers[loop] = loop.create_task(self._drive(loop))
            driver.add_done_callback(_retrieved)
        return waiter.future

    def _drop_closed_loops(self) -> None:
        """Ends the requests of loops that have gone away (nobody can read their results)."""
        for loop in [lp for lp in self._waiting if lp.is_closed()]:
            for rid in self._waiting.pop(loop):
                self.engine.abort(rid)
            self._drivers.pop(loop, None)

    async def end_program(self, program_id: str) -> None:
        with self._lock:
            self.engine.end_program(program_id)

    def _abort(self, waiters: list[_Waiter]) -> None:
        waiting = self._waiting.get(asyncio.get_running_loop(), {})
        with self._lock:
            for waiter in waiters:
                if waiting.pop(waiter.req.rid, None) is not None:
                    self.engine.abort(waiter.req.rid)

    async def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting = self._waiting[loop]
        while waiting:
            await asyncio.sleep(0)  # let programs submit what they have before the next step
            try:
                with self._lock:
                    stepped = self.engine.step()
            except Exception as exc:  # an engine failure fails every request waiting on it
                waiters = list(waiting.values())
                for waiter in waiters:
                    if not waiter.future.done():
                        waiter.future.set_exception(exc)
                try:
                    self._abort(waiters)  # and ends them: nobody will read what they would compute
                except Exception:
                    logger.exception("aborting the requests of a failed step failed too")
                    waiting.clear()
                return
            woken = False
            with self._lock:
                for waiter in list(waiting.values()):
                    woken |= self._publish(waiting, waiter)
            if woken and waiting:
                await _settle()
            if not stepped:  # a batch window is open, a guide is being built, or another loop's
                with self._lock:  # driver ran the step: wait off the loop; a submit wakes it
                    timeout = self.engine.idle_timeout()
                await asyncio.to_thread(self.engine.wait_for_work, timeout)

    def _publish(self, waiting: dict[str, _Waiter], waiter: _Waiter) -> bool:
        """Passes on what waiter's request produced; True when it finished a program's call."""
        req = waiter.req
        if waiter.published is not None:
            delta = waiter.published.push(req.output_ids)
            if delta:
                waiter.on_text(delta)
        if not req.finished:
            return False
        del waiting[req.rid]
        if waiter.published is not None:
            tail = waiter.published.finish()
            if tail:
                waiter.on_text(tail)
        output = self.engine.output(req)
        self.token_usage.add(output.meta)
        if not waiter.future.done():
            waiter.future.set_result(output)
        return req.call is not None

    def _waiters_of(self, futures: list[asyncio.Future]) -> list[_Waiter]:
        waiting = self._waiting.get(asyncio.get_running_loop(), {})
        return [w for w in list(waiting.values()) if w.future in futures]

    async def _wait(self, futures: list[asyncio.Future]) -> list[RequestOutput]:
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:  # cancelled or failed: stop what is still running
            self._abort(self._waiters_of(futures))
            raise

    async def generate(self, ids: list[int], params: SamplingParams,
                       on_text: OnText | None = None) -> RequestOutput:
        (out,) = await self._wait([self._submit(ids, params, on_text)])
        return out

    async def generate_batch(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        futures = []
        try:
            for ids, params in requests:
                futures.append(self._submit(ids, params, None))
        except BaseException:  # a bad prompt: the ones submitted before it are withdrawn
            self._abort(self._waiters_of(futures))
            raise
        return await self._wait(futures)

    async def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.engine.stats()
