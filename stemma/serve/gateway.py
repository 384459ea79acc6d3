"""The gateway process: the server's front door. All text work happens here, never in the engine.

    clients ── DEALER [api key, body] ──▶ ROUTER ─┐
                                                  ├─ Gateway ── PUSH ──▶ engine process
    clients ◀─ TokenChunk / Finished / ... ─ ROUTER ┘    │   ◀── PULL ──
    HTTP clients ◀──▶ uvicorn thread ◀── Bridge ───────┘   (stemma.serve.http; when http_port is set)

It checks the API key of every frame (a wrong key gets an `unauthorized` reply and nothing else),
enforces the frame size limit, decodes and validates, tokenizes text prompts (long ones on a
worker thread, serve.prompt_jobs), gives each request an engine-side id, forwards it, and
detokenizes the engine's token ids incrementally (UTF-8 holdback, stop-string trimming) on their
way back to the right client.

HTTP requests reach the same routing table through the in-process Bridge, as message objects
under int peer ids (ZeroMQ peers are bytes). With HTTP on, the gateway also keeps the Prometheus
metrics (of every request, both fronts) and polls the engine's stats once a second.

A client whose connection closes has its requests aborted (see peer_watch). A client that stops
reading while its replies pile up (CLIENT_HWM frames queued for it) is cut off: its requests are
aborted, and it is owed a `cut_off` error per request, sent once it reads again.

The gateway is the engine's parent (serve.supervisor). When the engine dies or hangs, every
request in flight gets an `engine_dead` error naming the cause, and new ones get the same until a
fresh engine is ready (restarts are bounded); with no restart left the gateway exits with
status 3. An error met turning one request's output into text fails that request only.

With `dp` > 1 the gateway runs that many engines (serve.replica), each on its own share of the
cores, and a Router (serve.router) picks the replica of each generate request; the rest follow
it there (aborts), a program's end goes where its calls went, health probes go to the least
loaded replica, and stats, cache flushes and cache trees go to every serving replica, their
answers merged into one reply (serve.fanout). A replica that dies fails only its own requests;
routing skips it until it is back, and the gateway exits only when no replica is left.

Run as `python -m stemma.serve.gateway` with a JSON spec (the fields of GatewaySpec) on stdin.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from stemma import protocol as P
from stemma.protocol.transport import ipv6_literal
from stemma.serve.http.bridge import CLOSE, Bridge
from stemma.gc_pauses import GC_PAUSES
from stemma.log import check_level, configure as configure_logging
from stemma.text.detokenizer import TextStream
from stemma.text.tokenizer import encode_prompt, load_tokenizer, preload_tokenizers
from stemma.serve.prompt_jobs import PromptJobs
from stemma.serve.routes import Pending, Routes, in_flight
from stemma.serve.peer_watch import PeerWatch, configure
from stemma.serve.proc_watch import ParentWatch
from stemma.serve.fanout import merge
from stemma.serve.replica import Replica, address, cpu_shares
from stemma.serve.ray_placement import RayPlacement
from stemma.serve.router import Router, Routing
from stemma.serve.supervisor import Supervision

POLL_MS = 100
TOKENIZING_POLL_MS = 5  # the poll's timeout while a prompt is tokenized on the worker thread
MAX_BURST = 256           # frames read from one socket before looking at the others
CLIENT_HWM = 4096         # frames queued for one ZeroMQ client before it is cut off (not reading)
CLOSE_LINGER_MS = 1000    # time given to final replies (errors) to reach clients on exit
EXIT_ENGINE_DEAD = 3
EXIT_HTTP_FAILED = 4
STATS_PERIOD_S = 1.0
LINK_WAIT_MS = 5000       # a ready engine's request connection is up by then (normally at once)
STATS_PEER = 0            # the gateway's own bridge peer: its stats polls (HTTP peers are >= 1)

logger = logging.getLogger("stemma.serve.gateway")  # not __name__: that is __main__ under -m


@dataclass(frozen=True)
class GatewaySpec:
    address: str                   # where clients connect: tcp://host:port or ipc://path
    requests: str                  # gateway -> engine
    outputs: str                   # engine -> gateway
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # the EngineConfig fields
    supervision: Supervision = dataclasses.field(default_factory=Supervision)
    api_key: str | None = None
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES
    log_level: str = "warning"     # one of stemma.log.LEVELS
    http_host: str = "127.0.0.1"
    http_port: int | None = None   # None: no HTTP front (stemma.Runtime)
    served_model_name: str | None = None
    dp: int = 1                    # engine replicas (serve.replica)
    routing: Routing = dataclasses.field(default_factory=Routing)
    ray: RayPlacement = dataclasses.field(default_factory=RayPlacement)  # serve.ray_replicas

    def __post_init__(self):
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        check_level(self.log_level)
        if self.http_port is not None and not 1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [1, 65535], got {self.http_port}")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")

    @classmethod
    def from_json(cls, text: str) -> "GatewaySpec":
        raw = json.loads(text)
        return cls(**{**raw, "supervision": Supervision(**raw.get("supervision", {})),
                      "routing": Routing(**raw.get("routing", {})), "ray": RayPlacement(**raw.get("ray", {}))})

    def engine_spec(self, cpus: list[int] | None = None) -> dict[str, Any]:
        """An engine process's spec (stemma.engine.process reads it on stdin), less its two
        addresses (the replica's own)."""
        spec: dict[str, Any] = {"engine": self.engine, "log_level": self.log_level}
        if self.dp > 1:
            spec.update(cpus=cpus, cache_events=self.routing.router == "cache_aware")
        if self.ray.enabled:  # on a Ray node: the actor's CPUs, no pinning
            spec.update(cpus=None, threads=max(1, int(self.ray.ray_num_cpus)))
        return spec


class Gateway:
    def __init__(self, spec: GatewaySpec, ctx: zmq.Context):
        self.spec = spec
        self.ctx = ctx
        self.key = spec.api_key.encode() if spec.api_key else None
        self.replicas = self._make_replicas()  # their engines start in start_engine
        self._by_pull = {r.pull: r for r in self.replicas}
        self.replica_router = Router(spec.dp, spec.routing)
        self.routes = Routes()
        self.prompt_jobs = PromptJobs()  # long text prompts being tokenized off the loop
        self.tokenizer: Any = None
        self.eos_token_ids: tuple[int, ...] = ()  # the engine's, from its EngineReady
        self.context_length = 0     # the engine's, from its EngineReady
        self.router: zmq.Socket | None = None
        self.peers: PeerWatch | None = None
        self.bridge: Bridge | None = None
        self.http = None            # the HttpState, when there is an HTTP front
        self.next_stats = 0.0
        # Invariant: while no replica serves, `unavailable` says why, and every request gets an
        # engine_dead error at once.
        self.unavailable = "the engine is loading"
        self.poller: zmq.Poller | None = None
        self.stalled: set[bytes] = set()     # ZeroMQ peers found not reading in this burst
        self.vanished: set[bytes] = set()    # ZeroMQ peers found unroutable in this burst
        self.owed: dict[bytes, list[P.ErrorMsg]] = {}  # cut-off peers: errors to send when they read

    def _make_replicas(self) -> list[Replica]:
        spec = self.spec
        if not spec.ray.enabled:
            return [Replica(i, self.ctx, address(spec.requests, i), address(spec.outputs, i),
                            spec.engine_spec(cpus), spec.supervision)
                    for i, cpus in enumerate(cpu_shares(spec.dp))]
        from stemma.serve import ray_replicas
        ray_replicas.connect(spec.ray.ray_address)
        where = f"tcp://{ray_replicas.node_address()}:*"

        def actor(i: int):
            return lambda engine: ray_replicas.RaySupervisor(
                engine, spec.supervision, f"stemma-engine-{os.getpid()}-{i}", spec.ray)
        return [Replica(i, self.ctx, where, where, spec.engine_spec(), spec.supervision, actor(i))
                for i in range(spec.dp)]

    @property
    def serving(self) -> bool:
        """Whether some replica serves."""
        return any(r.serving for r in self.replicas)

    @serving.setter
    def serving(self, value: bool) -> None:
        for r in self.replicas:
            r.serving = value

    @property
    def engine(self):
        """The first replica's Supervisor (the only one without --dp)."""
        return self.replicas[0].sup

    def attach_http(self, bridge: Bridge, state) -> None:
        self.bridge, self.http = bridge, state
        bridge.local_sinks[STATS_PEER] = self.on_stats

    # ---- startup ----
    def wait_engine(self, stopping: Callable[[], bool]) -> P.EngineReady | None:
        """The first replica's EngineReady once every replica's has come, or None if one died
        first (`dead()` says how) or we were told to stop first."""
        poller = zmq.Poller()
        for r in self.replicas:
            poller.register(r.pull, zmq.POLLIN)
        ready: dict[int, P.EngineReady] = {}
        while not stopping() and self.dead() is None:
            for sock, _ in poller.poll(POLL_MS):
                replica = self._by_pull[sock]
                msg = P.decode(sock.recv(), max_bytes=1 << 62)
                if isinstance(msg, P.EngineReady):
                    ready[replica.index] = msg
                    replica.sup.on_ready(msg.pid)
                    replica.pid = msg.pid
                    continue
                replica.sup.heard()  # a ready one waits for the others: heartbeats, cache events
                for item in msg.items if isinstance(msg, P.Batch) else ():
                    if isinstance(item, P.CacheEvents):
                        self.replica_router.on_events(replica.index, item.events, item.salts)
            if len(ready) == len(self.replicas):
                return ready[0]
        return None

    def dead(self) -> str | None:
        """Why a replica no longer serves (the first found), or None."""
        for r in self.replicas:
            cause = r.sup.dead()
            if cause is not None:
                return cause if len(self.replicas) == 1 else f"{r.name}: {cause}"
        return None

    def open(self, ready: P.EngineReady) -> None:
        self.tokenizer = load_tokenizer(ready.model)
        self.eos_token_ids = tuple(ready.eos_token_ids or ())
        self.context_length = ready.context_length
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        router.setsockopt(zmq.MAXMSGSIZE, 4 * self.spec.max_frame_bytes)  # hard cap: drop the peer
        # A full queue to a peer raises zmq.Again (see reply) instead of dropping the frame.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        configure(router)
        if ipv6_literal(self.spec.address):  # --host ::1
            router.setsockopt(zmq.IPV6, 1)
        self.peers = PeerWatch(router)
        try:
            router.bind(self.spec.address)
        except zmq.ZMQError as exc:  # closed here, or the context's term() would wait for it forever
            router.close(0)
            raise RuntimeError(f"cannot listen at {self.spec.address}: {exc.strerror}") from None
        self.router = router
        self.serving = True
        logger.debug("listening at %s for %s", self.spec.address, ready.model)

    # ---- the loop ----
    def run(self, stopping: Callable[[], bool], orphaned: Callable[[], bool]) -> int:
        self.poller = poller = zmq.Poller()
        for sock in (self.router, self.peers.monitor, *self._by_pull):
            poller.register(sock, zmq.POLLIN)
        for replica in self.replicas:
            self._watch_engine(replica)
        if self.bridge is not None:
            poller.register(self.bridge.fd, zmq.POLLIN)
        while True:
            if stopping() or orphaned():
                self.fail_all(P.SHUTTING_DOWN, "the server is shutting down")
                self._flush_bridge()
                return 0
            events = dict(poller.poll(TOKENIZING_POLL_MS if self.prompt_jobs else POLL_MS))
            self.reap()
            for replica in self.replicas:
                if replica.pull in events:
                    self._drain(replica.pull,
                                lambda frames, i=replica.index: self.on_engine(frames[0], i))
            if not self.supervise():  # after the drain: a frame just read is a sign of life
                self._flush_bridge()
                return EXIT_ENGINE_DEAD
            for replica in self.replicas:
                replica.flush()  # the aborts a full queue refused go before any new request
            if self.router in events:
                self._drain(self.router, self.on_client_guarded)
            self.send_tokenized()
            if self.bridge is not None:
                if self.bridge.fd in events:
                    for op in self.bridge.take():
                        self.on_local_guarded(op)
                if self.serving:
                    self.poll_stats()
                self.bridge.flush()
            self.drop_vanished()
            self.cut_off_stalled()
            self.pay_owed()

    def reap(self) -> None:
        """Drops the ZeroMQ peers whose connection closed (see peer_watch)."""
        for peer in self.peers.gone():
            self.owed.pop(peer, None)
            self.stalled.discard(peer)
            self.drop_peer(peer)

    def drop_vanished(self) -> None:
        """Drops the peers a reply could not be routed to (EHOSTUNREACH): their connection is
        gone. peer_watch reports most of them first; this catches a request read from a
        connection after it closed (see peer_watch), which would otherwise run to its end."""
        for peer in self.vanished:
            self.owed.pop(peer, None)
            self.drop_peer(peer)
        self.vanished.clear()

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
        for _ in range(MAX_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _flush_bridge(self) -> None:
        if self.bridge is not None:
            self.bridge.flush()

    def close(self) -> None:
        self.prompt_jobs.close()
        for replica in self.replicas:
            replica.close()
        if self.peers is not None:
            self.peers.close()
        if self.router is not None:
            self.router.close()  # lingers, so the last errors reach their clients

    # ---- the engine processes ----
    def start_engine(self, index: int | None = None) -> None:
        """Starts replica `index`'s engine (every replica's when None)."""
        for replica in self.replicas if index is None else [self.replicas[index]]:
            self._unwatch_engine(replica)
            replica.sup.start()
            self._watch_engine(replica)

    def _watch_engine(self, replica: Replica) -> None:
        if self.poller is not None and replica.sup.fd is not None:
            replica.fd = replica.sup.fd
            self.poller.register(replica.fd, zmq.POLLIN)

    def _unwatch_engine(self, replica: Replica) -> None:
        if self.poller is not None and replica.fd is not None:
            self.poller.unregister(replica.fd)  # before the Supervisor closes the pidfd
        replica.fd = None

    def supervise(self) -> bool:
        """Once a replica's engine has died or hung: fails its requests in flight with the
        cause, then starts a fresh engine if its restart budget allows. False when no replica
        is left (serving or restarting)."""
        for replica in self.replicas:
            if not replica.retired and replica.sup.dead() is not None:
                self._replica_died(replica)
        return not all(r.retired for r in self.replicas)

    def _replica_died(self, replica: Replica) -> None:
        others = [r for r in self.replicas if r is not replica and not r.retired]
        restart, plan = replica.sup.may_restart(last=not others)
        why = f"{replica.sup.cause}; {plan}"
        if len(self.replicas) > 1:
            why = f"{replica.name}: {why}"
        logger.error("%s", why)
        replica.serving = False
        replica.backlog.clear()
        self.replica_router.reset(replica.index)
        if not self.serving:
            self.unavailable = why
        self.fail_replica(replica.index, P.ENGINE_DEAD, why)
        if restart:
            self.start_engine(replica.index)
        else:
            replica.retired = True
            self._unwatch_engine(replica)

    def on_ready(self, ready: P.EngineReady, index: int = 0) -> None:
        """A restarted engine is ready: requests go to it again."""
        replica = self.replicas[index]
        if replica.serving:
            if ready.pid == replica.pid or not hasattr(replica.sup, "replaced"):
                logger.warning("an EngineReady from pid %d while %s serves; ignored", ready.pid,
                               replica.name)
                return
            replica.sup.replaced(replica.pid, ready.pid)  # Ray restarted it before we noticed
            self._replica_died(replica)
        was_serving = self.serving
        self.await_link(replica)
        replica.sup.on_ready(ready.pid)
        replica.pid = ready.pid
        replica.serving = True
        if self.http is not None and not was_serving:
            self.http.ready(ready, self.tokenizer)
        logger.info("the engine process (pid %d) of %s is ready again after restart %d", ready.pid,
                    replica.name, replica.sup.starts - 1)

    def await_link(self, replica: Replica | None = None) -> None:
        """Waits until the engines' request connections are up: an engine connects it before
        it sends EngineReady, but the two connections complete independently, and a PUSH with
        no connection refuses a non-blocking send."""
        for r in self.replicas if replica is None else [replica]:
            if not r.push.poll(LINK_WAIT_MS, zmq.POLLOUT):
                logger.warning("%s is ready, but its request connection is not up after %d ms",
                               r.name, LINK_WAIT_MS)

    # ---- replies ----
    def reply(self, peer: bytes | int, msg: P.Message) -> None:
        if isinstance(peer, int):
            self.bridge.deliver(peer, msg)
            return
        if peer in self.stalled:  # to be cut off after this burst: what it misses becomes an error
            return
        if peer in self.vanished:  # gone: dropped after this burst
            return
        if isinstance(msg, P.ErrorMsg) and msg.param is not None:
            # the field (version 5) is for the HTTP front, in this process: a ZeroMQ client of
            # version 4 or older could not read an error that carried it
            msg = dataclasses.replace(msg, param=None)
        try:
            self.router.send_multipart([peer, P.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:  # CLIENT_HWM frames wait for it: it does not read
            self.stalled.add(peer)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # gone: its connection closed. Dropped after this burst (not now: the caller may
            # still be using the peer's routes)
            self.vanished.add(peer)

    def error(self, peer: bytes | int, rid: str, code: str, message: str) -> None:
        logger.debug("request %r: replying %s: %s", rid, code, message)
        self.reply(peer, P.ErrorMsg(rid=rid, code=code, message=message))

    def fail_all(self, code: str, message: str) -> None:
        if self.http is not None:
            self.http.unavailable(code, message)
        for job in self.prompt_jobs.take_all():
            self.error(job.peer, job.msg.rid, code, message)
        for pending in self.routes.pop_all():
            self.error(pending.peer, pending.rid, code, message)

    def fail_replica(self, index: int, code: str, message: str) -> None:
        """Ends every request in flight on replica `index` with an error; a request spread over
        all replicas (stats, flush) stops waiting for it."""
        if self.http is not None and not self.serving:
            self.http.unavailable(code, message)
        for _, pending in self.routes.pop_replica(index):
            self.error(pending.peer, pending.rid, code, message)
        for gid, pending in self.routes.spread():
            if index in pending.expect:
                pending.expect.discard(index)
                if not pending.expect:
                    self._answer_spread(gid, pending)

    def cut_off_stalled(self) -> None:
        """Cuts off the ZeroMQ peers that stopped reading: aborts their requests and owes each
        request an error, sent once the peer reads again (so its memory here stays bounded)."""
        for peer in self.stalled:
            dropped = self.drop_peer(peer)
            logger.warning("a ZeroMQ client stopped reading its replies (%d frames wait for it): "
                           "cut off, %d requests aborted", CLIENT_HWM, len(dropped))
            self.owed.setdefault(peer, []).extend(
                P.ErrorMsg(rid=pending.rid, code=P.CUT_OFF,
                           message=f"the client did not read its replies ({CLIENT_HWM} frames "
                                   f"waited for it): the request was aborted")
                for _, pending in dropped)
        self.stalled.clear()

    def pay_owed(self) -> None:
        """Sends cut-off peers their errors, as far as their queues take them."""
        for peer in list(self.owed):
            errors = self.owed[peer]
            while errors:
                try:
                    self.router.send_multipart([peer, P.encode(errors[0])], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    errors.clear()  # gone: nobody to tell
                    break
                errors.pop(0)
            if not errors:
                del self.owed[peer]

    # ---- from clients ----
    def on_client_guarded(self, frames: list[zmq.Frame]) -> None:
        """on_client, but a bug met while serving one client fails only that message."""
        try:
            self.on_client(frames)
        except Exception as exc:
            logger.exception("internal error while handling a client message")
            self.error(frames[0].bytes, "", P.INTERNAL, f"{type(exc).__name__}: {exc}")

    def on_local_guarded(self, op: tuple[str, int, P.Message | None]) -> None:
        """A message (or a close) from an HTTP request, through the bridge: as on_client."""
        kind, peer, msg = op
        try:
            if kind == CLOSE:
                self.drop_peer(peer)
            else:
                self.on_message(peer, msg)
        except Exception as exc:
            logger.exception("internal error while handling an HTTP request's message")
            self.error(peer, getattr(msg, "rid", ""), P.INTERNAL, f"{type(exc).__name__}: {exc}")

    def poll_stats(self) -> None:
        """Once a second, the engine's stats for the gauges and the dashboard (no pool audit)."""
        now = time.monotonic()
        if now < self.next_stats:
            return
        self.next_stats = now + STATS_PERIOD_S
        msg = P.GetInfo(rid=f"stats-{now}", check_pool=False)
        self.forward(STATS_PEER, msg, self._spread(STATS_PEER, msg))

    def on_stats(self, msg: P.Message) -> None:
        if isinstance(msg, P.Info):
            self.http.metrics.on_stats(msg.stats)
            self.http.history.append((time.time(), msg.stats))

    def on_client(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if peer in self.owed:  # cut off: ignored until it has read the errors it is owed
            return
        if len(frames) != 3:
            self.stranger(peer, f"{len(frames) - 1} frames, not [api key, body]")
            self.error(peer, "", P.BAD_REQUEST, "a message is two frames: [api key, body]")
            return
        if self.key is not None and not hmac.compare_digest(frames[1].bytes, self.key):
            self.error(peer, "", P.UNAUTHORIZED, "missing or wrong API key")
            return
        body = frames[2]
        # seen() drains the disconnect events first (see peer_watch's invariant); dropping the
        # peers they name before acting on this frame aborts their requests at once
        self.peers.seen(peer, body)
        self.reap()
        try:
            msg = P.decode(body.bytes, P.CLIENT_REQUESTS, self.spec.max_frame_bytes)
        except P.ProtocolError as exc:
            if len(body) > self.spec.max_frame_bytes:
                self.error(peer, exc.rid, P.TOO_LARGE, str(exc))  # stemma's, past --max-frame-bytes
                return
            self.stranger(peer, str(exc))
            self.error(peer, exc.rid, P.BAD_REQUEST, str(exc))
            return
        self.on_message(peer, msg)

    def stranger(self, peer: bytes, why: str) -> None:
        """One warning line per peer that sends what is not stemma's protocol (an HTTP client at
        the ZeroMQ port, most often); each such message still gets its error reply."""
        if self.peers.first_strange(peer):
            logger.warning("a client at the ZeroMQ port %s sent a message that is not stemma's "
                           "protocol (%s); an HTTP client belongs on the HTTP port",
                           self.spec.address, why[:200])

    def on_message(self, peer: bytes | int, msg: P.Message) -> None:
        if not self.serving:  # the engine is restarting (health probes too: not healthy)
            if not isinstance(msg, (P.Abort, P.EndProgram)):  # the two that get no reply
                self.error(peer, msg.rid, P.ENGINE_DEAD, self.unavailable)
        elif isinstance(msg, P.GenerateReq):
            self.on_generate(peer, msg)
        elif isinstance(msg, P.Abort):
            if self.prompt_jobs.abort(peer, msg.rid):
                return  # sent on once the request is
            gid = self.routes.find(peer, msg.rid)
            replica = self.routes.get(gid).replica if gid is not None else -1
            if replica >= 0:  # a spread request (stats, flush) has nothing to abort
                self.replicas[replica].send_control(P.Abort(rid=gid))
        elif isinstance(msg, P.EndProgram):  # no reply, not even "overloaded": a hint only
            index = self.replica_router.end_program(msg.program_id)
            for replica in self.replicas:
                if replica.serving and index in (None, replica.index):
                    replica.send_control(msg)
        elif isinstance(msg, P.Health):  # to every replica: the first that answers speaks for the
            self.forward(peer, msg, self._spread(peer, msg))  # server (one stalled must not fail it)
        elif isinstance(msg, P.FlushCache) and len(self.replicas) > 1 and any(
                self.routes.loads(len(self.replicas))):  # all or nothing: an idle replica would
            self.reply(peer, P.FlushDone(rid=msg.rid, ok=False))  # flush beside a busy one
        else:  # stats, flushes, cache trees: every serving replica's, merged (serve.fanout)
            self.forward(peer, msg, self._spread(peer, msg))

    def _spread(self, peer: bytes | int, msg: P.Message) -> Pending:
        """`msg` for every serving replica: one Pending that waits for each one's answer."""
        return Pending(peer, msg.rid, msg.TAG, replica=-1,
                       expect={r.index for r in self.replicas if r.serving})

    def on_generate(self, peer: bytes | int, msg: P.GenerateReq) -> None:
        if PromptJobs.wanted(msg, self.tokenizer):
            taken = self.routes.find(peer, msg.rid) is not None
            if self.prompt_jobs.full(msg):
                self.error(peer, msg.rid, P.OVERLOADED, "too many long prompts are waiting to be "
                           "tokenized; try again later")
            elif taken or not self.prompt_jobs.submit(peer, msg, self.tokenizer):
                self.error(peer, msg.rid, P.BAD_REQUEST, in_flight(msg.rid))
            return
        try:
            ids = msg.input_ids if msg.input_ids is not None else encode_prompt(self.tokenizer, msg.prompt)
        except ValueError as exc:
            self.error(peer, msg.rid, P.BAD_REQUEST, str(exc))
            return
        self.send_generate(peer, msg, ids)

    def send_tokenized(self) -> None:
        """Sends on the requests whose prompts the worker thread has tokenized (an Abort that came
        meanwhile follows its request)."""
        for job in self.prompt_jobs.finished():
            peer, rid = job.peer, job.msg.rid
            try:
                ids = job.ids.result()
                if not self.serving:
                    self.error(peer, rid, P.ENGINE_DEAD, self.unavailable)
                    continue
                self.send_generate(peer, job.msg, ids)
                if job.aborted:
                    self.on_message(peer, P.Abort(rid=rid))
            except ValueError as exc:
                self.error(peer, rid, P.BAD_REQUEST, str(exc))
            except Exception as exc:  # as on_client_guarded: a bug fails this request only
                logger.exception("internal error while sending on a tokenized prompt")
                self.error(peer, rid, P.INTERNAL, f"{type(exc).__name__}: {exc}")

    def send_generate(self, peer: bytes | int, msg: P.GenerateReq, ids: list[int]) -> None:
        if len(ids) >= self.context_length > 0:  # the engine checks the finer limits
            self.error(peer, msg.rid, P.BAD_REQUEST, f"prompt of {len(ids)} tokens does not fit the "
                       f"context of {self.context_length} tokens")
            return  # not shipped: decoding megabytes of ids would stall the engine's steps
        logger.debug("request %r received: %d prompt tokens, n=%d, stream=%s",
                     msg.rid, len(ids), msg.params.n, msg.stream)
        replica = self._route(ids, msg)
        pending = Pending(peer, msg.rid, msg.TAG, msg.stream, msg.params.n, ids, msg.params,
                          program=msg.program, replica=replica)
        self.forward(peer, dataclasses.replace(msg, prompt=None, input_ids=ids), pending)

    def _route(self, ids: list[int], msg: P.GenerateReq) -> int:
        if len(self.replicas) == 1:
            return 0
        program = msg.call.program_id if msg.call is not None else None
        return self.replica_router.choose(ids, msg.salt, program, self.routes.loads(len(self.replicas)),
                                          [r.serving for r in self.replicas])

    def forward(self, peer: bytes | int, msg: P.Message, pending: Pending) -> None:
        """Registers the request and sends it on under its engine-side id (to every replica it
        expects an answer from, when it is spread)."""
        try:
            gid = self.routes.add(pending)
        except ValueError as exc:
            self.error(peer, pending.rid, P.BAD_REQUEST, str(exc))
            return
        if pending.kind != P.Health.TAG:  # health probes come many a second: not worth a line each
            logger.debug("request %r (%s): routed to engine id %s on replica %s", pending.rid,
                         pending.kind, gid, pending.replica if pending.expect is None else "all")
        msg = dataclasses.replace(msg, rid=gid)
        targets = [pending.replica] if pending.expect is None else sorted(pending.expect)
        for index in targets:
            if not self.to_engine(index, peer, pending.rid, msg):
                self.routes.pop(gid)
                return

    def to_engine(self, index: int, peer: bytes | int, rid: str, msg: P.Message) -> bool:
        if self.replicas[index].send(msg):
            return True
        self.error(peer, rid, P.OVERLOADED, "the engine's queue is full; try again later")
        return False

    def drop_peer(self, peer: bytes | int) -> list[tuple[str, Pending]]:
        """A client went away (or was cut off): aborts its generate requests, forgets the rest;
        returns what it had in flight."""
        self.prompt_jobs.drop_peer(peer)
        dropped = self.routes.pop_peer(peer)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("client %s gone: dropping %d requests %s",
                         peer.hex() if isinstance(peer, bytes) else f"http-{peer}", len(dropped),
                         [pending.rid for _, pending in dropped])
        for gid, pending in dropped:
            if pending.kind == P.GenerateReq.TAG and self.replicas[pending.replica].serving:
                self.replicas[pending.replica].send_control(P.Abort(rid=gid))
        return dropped

    # ---- from the engine ----
    def on_engine(self, frame: zmq.Frame, index: int = 0) -> None:
        """A frame from replica `index`'s engine."""
        msg = P.decode(frame.bytes, max_bytes=1 << 62)  # trusted, and may be large
        replica = self.replicas[index]
        replica.sup.heard()
        if isinstance(msg, P.Heartbeat):
            return
        if isinstance(msg, P.EngineReady):
            self.on_ready(msg, index)
            return
        if not replica.serving:  # a dead engine's last words: its requests have had their error
            return
        for item in msg.items if isinstance(msg, P.Batch) else [msg]:
            if isinstance(item, P.CacheEvents):
                self.replica_router.on_events(index, item.events, item.salts)
                continue
            pending = self.routes.get(item.rid)
            if pending is None:  # its client is gone (the engine still says how it ended)
                if isinstance(item, P.Finished) and self.http is not None:
                    self.http.metrics.on_finished(item.finish_reason, item.meta)
                continue
            if pending.expect is not None:
                self.on_part(item, pending, index)
                continue
            try:
                self.on_reply(item, pending)
            except Exception as exc:  # a detokenizer error, say: this request ends, the rest go on
                self.fail_request(item.rid, pending, exc)

    def on_part(self, item: P.Message, pending: Pending, index: int) -> None:
        """Replica `index`'s answer to a request spread over the replicas; the merged reply
        goes out once every replica it waits for has answered (or died)."""
        if index not in pending.expect:
            return
        pending.expect.discard(index)
        pending.parts[index] = item
        if isinstance(item, P.FlushDone) and item.ok:  # its exact tree hears a clear event
            self.replica_router.approx[index].clear()
        if isinstance(item, P.HealthOk):  # one replica alive answers for the server
            pending.parts = {index: item}
            pending.expect.clear()
        if not pending.expect:
            self._answer_spread(item.rid, pending)

    def _answer_spread(self, gid: str, pending: Pending) -> None:
        self.routes.pop(gid)
        if not pending.parts:
            self.error(pending.peer, pending.rid, P.ENGINE_DEAD, self.unavailable)
            return
        item = merge(pending.parts, self._router_stats())
        if isinstance(item, P.CacheTree):
            item = dataclasses.replace(item, requests=self.described(item.requests))
        if isinstance(item, P.ErrorMsg):
            logger.debug("request %r: a replica replied %s: %s", pending.rid, item.code, item.message)
        self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid))

    def _router_stats(self) -> dict | None:
        return self.replica_router.stats() if len(self.replicas) > 1 else None

    def on_reply(self, item: P.Message, pending: Pending) -> None:
        """One engine reply to `pending` (engine id `item.rid`), on its way to the client."""
        if isinstance(item, P.TokenChunk):
            text = self.text(pending, item.index).push(item.token_ids) if self.tokenizer else ""
            self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid, text=text))
        elif isinstance(item, P.Finished):
            self.on_finished(item, pending)
        else:  # an error, or the answer to a control request: the request's last word
            if isinstance(item, P.ErrorMsg):
                logger.debug("request %r: the engine replied %s: %s", pending.rid, item.code,
                             item.message)
            self.routes.pop(item.rid)
            self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid))

    def fail_request(self, gid: str, pending: Pending, exc: Exception) -> None:
        """Ends one request whose reply could not be handled: aborted in the engine, forgotten
        here, and its client told why."""
        logger.exception("request %r: its output could not be turned into its reply", pending.rid)
        if self.routes.get(gid) is pending:
            self.routes.pop(gid)
        if pending.kind == P.GenerateReq.TAG:
            self.replicas[pending.replica].send_control(P.Abort(rid=gid))
        self.error(pending.peer, pending.rid, P.INTERNAL,
                   f"the server could not turn the engine's output into text "
                   f"({type(exc).__name__}: {exc}); the request was aborted")

    def described(self, requests: list[dict]) -> list[dict]:
        """The engine's request list with each one's client rid and program added."""
        out = []
        for entry in requests:
            pending = self.routes.get(str(entry.get("rid", "")).split("-", 1)[0])
            out.append({**entry, "client_rid": pending.rid if pending else None,
                        "program": pending.program if pending else None})
        return out

    def on_finished(self, item: P.Finished, pending: Pending) -> None:
        if self.http is not None:
            self.http.metrics.on_finished(item.finish_reason, item.meta)
        text = ""
        if self.tokenizer is not None:
            stream = self.text(pending, item.index)
            if not pending.stream:
                stream.push(item.token_ids)
            tail = stream.finish()
            if pending.stream and tail:
                self.reply(pending.peer, P.TokenChunk(rid=pending.rid, index=item.index, token_ids=[],
                                                      text=tail))
            text = stream.text
        self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid, text=text))
        logger.debug("request %r finished (sequence %d of %d): %s, %d tokens", pending.rid,
                     item.index + 1, pending.n, item.finish_reason, len(item.token_ids))
        pending.done += 1
        if pending.done == pending.n:
            self.routes.pop(item.rid)

    def text(self, pending: Pending, index: int) -> TextStream:
        if index not in pending.texts:
            pending.texts[index] = TextStream.of(self.tokenizer, pending.params, pending.input_ids,
                                                 self.eos_token_ids)
        return pending.texts[index]


def main(spec_json: str | None = None) -> int:
    spec = GatewaySpec.from_json(spec_json if spec_json is not None else sys.stdin.read())
    configure_logging(spec.log_level, prefix="stemma gateway")
    stop = {"now": False}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `serve` turns Ctrl-C into SIGTERM for us
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    parent = ParentWatch()
    ctx = zmq.Context()
    gateway = Gateway(spec, ctx)
    http = None
    try:
        if spec.http_port is not None:  # up while the model loads: /health says 503 meanwhile
            try:
                http = start_http(gateway, spec)
            except RuntimeError as exc:
                logger.error("%s", exc)
                return EXIT_HTTP_FAILED
        gateway.start_engine()
        preload_tokenizers()  # slow to import: do it while the engine loads
        ready = gateway.wait_engine(lambda: stop["now"] or parent.orphaned())
        if ready is None:
            cause = gateway.dead()
            if cause is not None:  # not restarted: a model that fails to load fails again
                logger.error("%s before it was ready", cause)
                return EXIT_ENGINE_DEAD
            return 0
        gateway.await_link()
        gateway.open(ready)
        if gateway.http is not None:
            gateway.http.ready(ready, gateway.tokenizer)
        GC_PAUSES.enable()  # its startup (the tokenizer, the HTTP app) is long-lived
        return gateway.run(lambda: stop["now"] or (http is not None and not http.alive()),
                           parent.orphaned)
    finally:
        if http is not None:
            http.stop()
        gateway.close()
        ctx.term()


def start_http(gateway: Gateway, spec: GatewaySpec):
    """The HTTP front on its thread, attached to `gateway` (imported here: ZeroMQ-only gateways,
    as stemma.Runtime starts them, never load FastAPI)."""
    from stemma.serve.http.server import HttpServer
    from stemma.serve.http.state import HttpState
    from stemma.serve.metrics import Metrics
    bridge = Bridge()
    state = HttpState(bridge, spec.api_key, Metrics(), spec.served_model_name,
                      spec.max_frame_bytes)
    gateway.attach_http(bridge, state)
    server = HttpServer(state, spec.http_host, spec.http_port)
    server.start()
    logger.debug("HTTP on %s:%d", spec.http_host, spec.http_port)
    return server


if __name__ == "__main__":
    sys.exit(main())
