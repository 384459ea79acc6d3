"""The engine process: one `Engine` fed by the gateway over ZeroMQ, answering in token ids only.

    gateway ── PUSH requests ──▶ PULL ─▶ EngineLoop ─▶ PUSH outputs ──▶ gateway

The gateway binds both sockets and the engine connects. While requests run, the loop takes in
whatever has arrived without waiting and steps; when idle it blocks on the socket (with a timeout,
to notice that its parent is gone). Each step's chunks and finishes travel as one Batch frame.
Text never enters this process, except where the scheduler matches stop strings.

A sequence that failed from a fault while it was served (req.fault: an exception in the engine,
not its input) ends its whole request with one ErrorMsg(code=INTERNAL), which clients raise; the
request's other sequences are aborted, so an n > 1 group fails as one. Errors that come from the
request itself (a constraint that failed to build or timed out) end their sequence with finish
reason "error" and meta["error"] in its Finished, as before.

Run as `python -m stemma.engine.process` with a JSON spec on stdin: `engine` (the
EngineConfig fields), `requests` and `outputs` (the gateway's addresses), and for a replica of
several (serve --dp) `cpus` (the cores it runs on, one thread each) or, on a Ray node, `threads`,
and `cache_events` (send the radix tree's changes, CacheEvents, for the gateway's cache-aware
router).
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import zmq

from stemma import protocol as P
from stemma.log import configure as configure_logging
from stemma.serve.proc_watch import ParentWatch
from stemma.engine.cache_events import CacheEventLog
from stemma.engine.cache_tree import cache_tree
from stemma.engine.heap import HeapTrimmer
from stemma.engine.request import Request
from stemma.gc_pauses import GC_PAUSES
from stemma.engine.output import request_output
from stemma.text.publisher import Publisher

if TYPE_CHECKING:
    from stemma.engine.engine import Engine

IDLE_POLL_MS = 250
MAX_INTAKE = 512          # messages taken in between two steps, so that steps are not starved
SEND_TIMEOUT_MS = 10_000  # a gateway that stops reading for this long is taken for dead
HEARTBEAT_PERIOD_S = 1.0  # the longest the loop stays silent between two steps once ready

logger = logging.getLogger("stemma.engine.process")  # not __name__: that is __main__ under -m


@dataclass
class Live:
    """A running sequence: the gateway's request id, its index among `n`, and what was sent."""
    req: Request
    rid: str
    index: int
    stream: bool
    published: Publisher = field(default_factory=Publisher)


def _chunk(live: Live, new: slice) -> P.TokenChunk:
    req = live.req
    return P.TokenChunk(
        rid=live.rid, index=live.index, token_ids=req.output_ids[new],
        logprobs=req.output_logprobs[new] if req.params.logprobs else None,
        top_logprobs=[list(t) for t in req.output_top_logprobs[new]] if req.params.top_logprobs else None)


class EngineLoop:
    def __init__(self, engine: Engine, requests: zmq.Socket, outputs: zmq.Socket,
                 cache_events: bool = False):
        self.engine = engine
        self.requests = requests
        self.outputs = outputs
        self.live: dict[str, Live] = {}           # engine rid -> sequence
        self.groups: dict[str, list[str]] = {}    # gateway rid -> engine rids of its n sequences
        self.outbox: list[P.Message] = []
        self.next_beat = 0.0
        self.heap = HeapTrimmer(engine.config.heap_trim_interval_s)
        self.cache_events = CacheEventLog(engine.cache.tree) if cache_events else None

    # ---- intake ----
    def handle(self, msg: P.Message) -> None:
        """Takes in one message; a fault while taking it in fails that message alone (its
        sender gets an INTERNAL error), never the loop."""
        try:
            self._handle(msg)
        except zmq.ZMQError:  # the link to the gateway, not the message: as from any send
            raise
        except Exception as exc:
            logger.exception("taking in a %r message failed", msg.TAG)
            self.outbox.append(P.ErrorMsg(rid=getattr(msg, "rid", ""), code=P.INTERNAL,
                                          message=f"internal error taking in the request: "
                                                  f"{type(exc).__name__}: {exc}"))

    def _handle(self, msg: P.Message) -> None:
        if isinstance(msg, P.GenerateReq):
            self._generate(msg)
        elif isinstance(msg, P.Abort):
            for engine_rid in list(self.groups.get(msg.rid, ())):
                if self.engine.abort(engine_rid) is not None:
                    self._publish(self.live[engine_rid])
        elif isinstance(msg, P.EndProgram):
            self.engine.end_program(msg.program_id)
        elif isinstance(msg, P.FlushCache):
            self.send(P.FlushDone(rid=msg.rid, ok=self.engine.flush_cache()))
        elif isinstance(msg, P.GetInfo):
            self.send(self.info(msg.rid, msg.check_pool))
        elif isinstance(msg, P.GetCacheTree):
            nodes, requests = cache_tree(self.engine, msg.limit)
            self.send(P.CacheTree(rid=msg.rid, nodes=nodes, requests=requests))
        elif isinstance(msg, P.Health):
            self.send(P.HealthOk(rid=msg.rid))
        else:
            self.outbox.append(P.ErrorMsg(rid=getattr(msg, "rid", ""), code=P.BAD_REQUEST,
                                          message=f"the engine does not take {msg.TAG!r} messages"))

    def _generate(self, msg: P.GenerateReq) -> None:
        prompt = msg.input_ids if msg.input_ids is not None else msg.prompt
        try:
            reqs = self.engine.submit(prompt, msg.params, rid=msg.rid, salt=msg.salt, call=msg.call)
        except ValueError as exc:
            logger.debug("request %s rejected: %s", msg.rid, exc)
            self.outbox.append(P.ErrorMsg(rid=msg.rid, code=P.BAD_REQUEST, message=str(exc),
                                          param=getattr(exc, "param", None)))
            return
        self.groups[msg.rid] = [r.rid for r in reqs]
        logger.debug("request %s taken in: %d sequences", msg.rid, len(reqs))
        for i, req in enumerate(reqs):
            self.live[req.rid] = Live(req, msg.rid, i, msg.stream)

    def info(self, rid: str, check_pool: bool = True) -> P.Info:
        engine = self.engine
        stats = {**engine.stats(), **GC_PAUSES.stats(), "pid": os.getpid()}
        try:
            if check_pool:
                engine.check_pool_whole()
                stats["pool_whole"] = True
        except AssertionError as exc:
            stats["pool_whole"], stats["pool_error"] = False, str(exc)
        return P.Info(rid=rid, model=str(engine.loaded.source), context_length=engine.runner.max_context,
                      vocab_size=engine.loaded.spec.vocab_size, stats=stats)

    # ---- output ----
    def _publish(self, live: Live) -> None:
        """Queues what `live` produced since the last call, and its end once finished."""
        if live.req.fault:
            self._fail_group(live)
            return
        new = live.published.take(live.req.output_ids) if live.stream else None
        if new is not None:
            self.outbox.append(_chunk(live, new))
        if live.req.finished:
            self.outbox.append(P.Finished.of(request_output(live.req), live.rid, live.index))
            del self.live[live.req.rid]
            group = self.groups[live.rid]
            group.remove(live.req.rid)
            if not group:
                del self.groups[live.rid]

    def _fail_group(self, live: Live) -> None:
        """live's sequence failed internally: its request ends with one INTERNAL error, and the
        request's other sequences are aborted (their KV released, nothing more sent)."""
        for engine_rid in self.groups.pop(live.rid, ()):
            self.engine.abort(engine_rid)  # None for live's own, finished already
            del self.live[engine_rid]
        logger.warning("request %s failed: %s", live.rid, live.req.error)
        self.outbox.append(P.ErrorMsg(rid=live.rid, code=P.INTERNAL,
                                      message=live.req.error or "internal error"))

    def send(self, msg: P.Message) -> None:
        self.outputs.send(P.encode(msg))

    def flush(self) -> None:
        events = self.cache_events.take() if self.cache_events is not None else None
        if events is not None:
            self.outbox.append(events)
        if self.outbox:
            self.send(P.Batch(items=self.outbox))
            self.outbox = []

    def beat(self) -> None:
        """A Heartbeat once HEARTBEAT_PERIOD_S has passed since the last one: the gateway's proof
        that this loop still turns (a step longer than its engine timeout reads as a hang)."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.next_beat = now + HEARTBEAT_PERIOD_S
            self.send(P.Heartbeat(sent=now))

    # ---- the loop ----
    def take_in(self, timeout_ms: int) -> None:
        if not self.requests.poll(timeout_ms):
            return
        for _ in range(MAX_INTAKE):
            try:
                frame = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frame, max_bytes=1 << 62)
            except P.ProtocolError as exc:  # the gateway sent something broken: say so, go on
                self.outbox.append(P.ErrorMsg(rid=exc.rid, code=P.BAD_REQUEST, message=str(exc)))
                continue
            self.handle(msg)

    def step(self) -> bool:
        """One engine step; False when it ran no forward (nothing to do, or a batch window is open)."""
        touched = self.engine.step()
        for req in touched:
            live = self.live.get(req.rid)
            if live is not None:
                self._publish(live)
        return bool(touched)

    def doze_ms(self) -> int:
        """How long to wait for input after a step that ran no forward while requests are live:
        the engine's idle timeout (a batch window, a retention hold), never past the next
        heartbeat, at least 1 ms; 1 ms while a guide builds (its completion wakes the engine's
        own wait, not this socket)."""
        if self.engine.scheduler.grammar_queue:
            return 1
        seconds = min(self.engine.idle_timeout(), self.next_beat - time.monotonic())
        return max(1, math.ceil(seconds * 1000))

    def run(self, stopping: Callable[[], bool]) -> None:
        while not stopping():
            self.take_in(0 if self.live else IDLE_POLL_MS)
            ran = bool(self.live) and self.step()
            if self.live and not ran:
                self.take_in(self.doze_ms())  # doze, but wake on input
            self.flush()
            if ran:  # after the flush: a trim or a settle never delays the step's tokens
                self.heap.worked()
            elif not self.live:
                self.heap.idle()
                GC_PAUSES.idle()
            self.beat()


def _connect(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.connect(address)
    return sock


def main(spec_json: str | None = None) -> int:
    spec = json.loads(spec_json if spec_json is not None else sys.stdin.read())
    configure_logging(spec.get("log_level", "warning"), prefix="stemma engine")
    stop = {"now": False}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `serve` turns Ctrl-C into SIGTERM for us
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    parent = ParentWatch()

    cpus = spec.get("cpus")
    if cpus:  # a replica of several (serve --dp): its own share of the cores
        os.sched_setaffinity(0, cpus)
    from stemma.engine.engine import Engine
    threads = len(cpus) if cpus else spec.get("threads")
    if threads:
        import torch
        torch.set_num_threads(threads)
    try:
        engine = Engine(**spec["engine"])
    except (ValueError, FileNotFoundError, ImportError) as exc:
        logger.error("%s", exc)
        return 2
    ctx = zmq.Context()
    requests = _connect(ctx, zmq.PULL, spec["requests"])
    outputs = _connect(ctx, zmq.PUSH, spec["outputs"])
    loop = EngineLoop(engine, requests, outputs, cache_events=bool(spec.get("cache_events")))
    GC_PAUSES.watch()
    if engine.config.gc_freeze:  # the model and its startup are long-lived: no collection scans them again
        GC_PAUSES.enable()
    loop.send(P.EngineReady(model=str(engine.loaded.source), context_length=engine.runner.max_context,
                             vocab_size=engine.loaded.spec.vocab_size, pid=os.getpid(),
                             eos_token_ids=list(engine.eos_token_ids)))
    logger.debug("ready: %s, context length %d", engine.loaded.source, engine.runner.max_context)
    try:
        loop.run(lambda: stop["now"] or parent.orphaned())
    except zmq.Again:
        logger.error("the gateway stopped reading; exiting")
        return 1
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
