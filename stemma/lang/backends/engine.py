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
"""
from __future__ import annotations

import asyncio
import logging
import time
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


@dataclass
class _Waiter:
    req: Request
    future: asyncio.Future
    on_text: OnText | None = None
    published: Publisher | None = None  # with a text stream, when on_text is set


class EngineBackend(Backend):
    def __init__(self, engine: Engine | None = None, **engine_config: Any):
        """`engine`: a stemma.Engine; None starts one from `engine_config` (EngineConfig fields)."""
        if engine is None:
            from stemma.engine.engine import Engine
            engine = Engine(**engine_config)
        elif engine_config:
            raise ValueError("pass an engine or engine options, not both")
        self.engine = engine
        self._codec = HFCodec(engine.tokenizer)
        self._waiting: dict[str, _Waiter] = {}   # request id -> its waiter
        self._driver: asyncio.Task | None = None

    @property
    def codec(self) -> TokenCodec:
        return self._codec

    def _submit(self, ids: list[int], params: SamplingParams, on_text: OnText | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if self._driver is not None and self._driver.get_loop() is not loop:
            self._abort(list(self._waiting.values()))  # left over from a loop that has gone away
        (req,) = self.engine.submit(ids, params, call=CURRENT_CALL.get())
        waiter = _Waiter(req, loop.create_future(), on_text)
        if on_text is not None:
            waiter.published = Publisher(self.engine.text_stream(req))
        self._waiting[req.rid] = waiter
        if self._driver is None or self._driver.done() or self._driver.get_loop() is not loop:
            self._driver = loop.create_task(self._drive())
        return waiter.future

    async def end_program(self, program_id: str) -> None:
        self.engine.end_program(program_id)

    def _abort(self, waiters: list[_Waiter]) -> None:
        for waiter in waiters:
            if self._waiting.pop(waiter.req.rid, None) is not None:
                self.engine.abort(waiter.req.rid)

    async def _drive(self) -> None:
        while self._waiting:
            await asyncio.sleep(0)  # let programs submit what they have before the next step
            try:
                stepped = self.engine.step()
            except Exception as exc:  # an engine failure fails every request waiting on it
                waiters = list(self._waiting.values())
                for waiter in waiters:
                    if not waiter.future.done():
                        waiter.future.set_exception(exc)
                try:
                    self._abort(waiters)  # and ends them: nobody will read what they would compute
                except Exception:
                    logger.exception("aborting the requests of a failed step failed too")
                    self._waiting.clear()
                return
            woken = False
            for waiter in list(self._waiting.values()):
                woken |= self._publish(waiter)
            if woken and self._waiting:
                await _settle()
            if not stepped:  # a batch window is open, or a guide is being built: wait off the
                timeout = self.engine.idle_timeout()  # loop; a submit wakes it
                await asyncio.to_thread(self.engine.wait_for_work, timeout)

    def _publish(self, waiter: _Waiter) -> bool:
        """Passes on what waiter's request produced; True when it finished a program's call."""
        req = waiter.req
        if waiter.published is not None:
            delta = waiter.published.push(req.output_ids)
            if delta:
                waiter.on_text(delta)
        if not req.finished:
            return False
        del self._waiting[req.rid]
        if waiter.published is not None:
            tail = waiter.published.finish()
            if tail:
                waiter.on_text(tail)
        output = self.engine.output(req)
        self.token_usage.add(output.meta)
        if not waiter.future.done():
            waiter.future.set_result(output)
        return req.call is not None

    async def _wait(self, futures: list[asyncio.Future]) -> list[RequestOutput]:
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:  # cancelled or failed: stop what is still running
            self._abort([w for w in self._waiting.values() if w.future in futures])
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
            self._abort([w for w in self._waiting.values() if w.future in futures])
            raise
        return await self._wait(futures)

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()
