"""The gateway process: the server's front door. All text work happens here, never in the engine.

    clients ── DEALER [api key, body] ──▶ ROUTER ─┐
                                                  ├─ Gateway ── PUSH ──▶ engine process
    clients ◀─ TokenChunk / Finished / ... ─ ROUTER ┘    │   ◀── PULL ──
    HTTP clients ◀──▶ uvicorn thread ◀── Bridge ───────┘   (stemma.serve.http; when http_port is set)

It checks the API key of every frame (a wrong key gets an `unauthorized` reply and nothing else),
enforces the frame size limit, decodes and validates, tokenizes text prompts, gives each request
an engine-side id, forwards it, and detokenizes the engine's token ids incrementally (UTF-8
holdback, stop-string trimming) on their way back to the right client.

HTTP requests reach the same routing table through the in-process Bridge, as message objects
under int peer ids (ZeroMQ peers are bytes). With HTTP on, the gateway also keeps the Prometheus
metrics (of every request, both fronts) and polls the engine's stats once a second.

A client whose connection closes has its requests aborted (see peer_watch). If the engine process
exits, every waiting client gets an `engine_dead` error and the gateway exits with status 3.

Run as `python -m stemma.serve.gateway` with a JSON spec (the fields of GatewaySpec) on stdin.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from stemma import protocol as P
from stemma.serve.http.bridge import CLOSE, Bridge
from stemma.log import check_level, configure as configure_logging
from stemma.text.detokenizer import TextStream
from stemma.text.tokenizer import encode_prompt, load_tokenizer, preload_tokenizers
from stemma.serve.routes import Pending, Routes
from stemma.serve.peer_watch import PeerWatch, configure
from stemma.serve.proc_watch import ParentWatch, ProcessWatch

POLL_MS = 100
MAX_BURST = 256           # frames read from one socket before looking at the others
INTERNAL_HWM = 100_000    # frames queued towards the engine before clients are told to back off
CLOSE_LINGER_MS = 1000    # time given to final replies (errors) to reach clients on exit
EXIT_ENGINE_DEAD = 3
EXIT_HTTP_FAILED = 4
STATS_PERIOD_S = 1.0
STATS_PEER = 0            # the gateway's own bridge peer: its stats polls (HTTP peers are >= 1)

logger = logging.getLogger("stemma.serve.gateway")  # not __name__: that is __main__ under -m


@dataclass(frozen=True)
class GatewaySpec:
    address: str                   # where clients connect: tcp://host:port or ipc://path
    requests: str                  # gateway -> engine
    outputs: str                   # engine -> gateway
    engine_pid: int
    api_key: str | None = None
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES
    log_level: str = "warning"     # one of stemma.log.LEVELS
    http_host: str = "127.0.0.1"
    http_port: int | None = None   # None: no HTTP front (stemma.Runtime)
    served_model_name: str | None = None

    def __post_init__(self):
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        check_level(self.log_level)
        if self.http_port is not None and not 1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [1, 65535], got {self.http_port}")


def _bind(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, INTERNAL_HWM)
    sock.setsockopt(zmq.RCVHWM, INTERNAL_HWM)
    sock.bind(address)
    return sock


class Gateway:
    def __init__(self, spec: GatewaySpec, ctx: zmq.Context):
        self.spec = spec
        self.ctx = ctx
        self.key = spec.api_key.encode() if spec.api_key else None
        self.to_engine_sock = _bind(ctx, zmq.PUSH, spec.requests)
        self.from_engine = _bind(ctx, zmq.PULL, spec.outputs)
        self.engine = ProcessWatch(spec.engine_pid)
        self.routes = Routes()
        self.tokenizer: Any = None
        self.router: zmq.Socket | None = None
        self.peers: PeerWatch | None = None
        self.bridge: Bridge | None = None
        self.http = None            # the HttpState, when there is an HTTP front
        self.next_stats = 0.0

    def attach_http(self, bridge: Bridge, state) -> None:
        self.bridge, self.http = bridge, state
        bridge.local_sinks[STATS_PEER] = self.on_stats

    # ---- startup ----
    def wait_engine(self, stopping: Callable[[], bool]) -> P.EngineReady | None:
        """The engine's EngineReady, or None if it exited (or we were told to stop) first."""
        while not stopping() and not self.engine.exited():
            if self.from_engine.poll(POLL_MS):
                return P.decode(self.from_engine.recv(), (P.EngineReady,))
        return None

    def open(self, ready: P.EngineReady) -> None:
        self.tokenizer = load_tokenizer(ready.model)
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        router.setsockopt(zmq.MAXMSGSIZE, 4 * self.spec.max_frame_bytes)  # hard cap: drop the peer
        configure(router)
        self.peers = PeerWatch(router)
        router.bind(self.spec.address)
        self.router = router
        logger.debug("listening at %s for %s", self.spec.address, ready.model)

    # ---- the loop ----
    def run(self, stopping: Callable[[], bool], orphaned: Callable[[], bool]) -> int:
        poller = zmq.Poller()
        for sock in (self.router, self.from_engine, self.peers.monitor):
            poller.register(sock, zmq.POLLIN)
        if self.engine.fd is not None:
            poller.register(self.engine.fd, zmq.POLLIN)
        if self.bridge is not None:
            poller.register(self.bridge.fd, zmq.POLLIN)
        while True:
            if self.engine.exited():
                self._drain(self.from_engine, lambda frames: self.on_engine(frames[0]))
                self.fail_all(P.ENGINE_DEAD, "the engine process died; the server is going down")
                if self.bridge is not None:
                    self.bridge.flush()
                return EXIT_ENGINE_DEAD
            if stopping() or orphaned():
                self.fail_all(P.SHUTTING_DOWN, "the server is shutting down")
                if self.bridge is not None:
                    self.bridge.flush()
                return 0
            events = dict(poller.poll(POLL_MS))
            for peer in self.peers.gone():  # before reading the ROUTER: see peer_watch
                self.drop_peer(peer)
            if self.from_engine in events:
                self._drain(self.from_engine, lambda frames: self.on_engine(frames[0]))
            if self.router in events:
                self._drain(self.router, self.on_client_guarded)
            if self.bridge is not None:
                if self.bridge.fd in events:
                    for op in self.bridge.take():
                        self.on_local_guarded(op)
                self.poll_stats()
                self.bridge.flush()

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
        for _ in range(MAX_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def close(self) -> None:
        self.engine.close()
        self.to_engine_sock.close()
        self.from_engine.close()
        if self.peers is not None:
            self.peers.close()
        if self.router is not None:
            self.router.close()  # lingers, so the last errors reach their clients

    # ---- replies ----
    def reply(self, peer: bytes | int, msg: P.Message) -> None:
        if isinstance(peer, int):
            self.bridge.deliver(peer, msg)
        else:
            self.router.send_multipart([peer, P.encode(msg)])

    def error(self, peer: bytes, rid: str, code: str, message: str) -> None:
        logger.debug("request %r: replying %s: %s", rid, code, message)
        self.reply(peer, P.ErrorMsg(rid=rid, code=code, message=message))

    def fail_all(self, code: str, message: str) -> None:
        if self.http is not None:
            self.http.going_down(code, message)
        for pending in self.routes.pop_all():
            self.error(pending.peer, pending.rid, code, message)

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
        rid = f"stats-{now}"
        self.forward(STATS_PEER, P.GetInfo(rid=rid, check_pool=False),
                     Pending(STATS_PEER, rid, P.GetInfo.TAG))

    def on_stats(self, msg: P.Message) -> None:
        if isinstance(msg, P.Info):
            self.http.metrics.on_stats(msg.stats)
            self.http.history.append((time.time(), msg.stats))

    def on_client(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if len(frames) != 3:
            self.stranger(peer, f"{len(frames) - 1} frames, not [api key, body]")
            self.error(peer, "", P.BAD_REQUEST, "a message is two frames: [api key, body]")
            return
        if self.key is not None and not hmac.compare_digest(frames[1].bytes, self.key):
            self.error(peer, "", P.UNAUTHORIZED, "missing or wrong API key")
            return
        body = frames[2]
        self.peers.seen(peer, body)
        try:
            msg = P.decode(body.bytes, P.CLIENT_REQUESTS, self.spec.max_frame_bytes)
        except P.ProtocolError as exc:
            code = P.TOO_LARGE if len(body) > self.spec.max_frame_bytes else P.BAD_REQUEST
            self.stranger(peer, str(exc))
            self.error(peer, exc.rid, code, str(exc))
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
        if isinstance(msg, P.GenerateReq):
            self.on_generate(peer, msg)
        elif isinstance(msg, P.Abort):
            gid = self.routes.find(peer, msg.rid)
            if gid is not None:
                self.to_engine(peer, msg.rid, P.Abort(rid=gid))
        else:
            self.forward(peer, msg, Pending(peer, msg.rid, msg.TAG))

    def on_generate(self, peer: bytes, msg: P.GenerateReq) -> None:
        try:
            ids = msg.input_ids if msg.input_ids is not None else encode_prompt(self.tokenizer, msg.prompt)
        except ValueError as exc:
            self.error(peer, msg.rid, P.BAD_REQUEST, str(exc))
            return
        logger.debug("request %r received: %d prompt tokens, n=%d, stream=%s",
                     msg.rid, len(ids), msg.params.n, msg.stream)
        pending = Pending(peer, msg.rid, msg.TAG, msg.stream, msg.params.n, ids, msg.params,
                          program=msg.program)
        self.forward(peer, dataclasses.replace(msg, prompt=None, input_ids=ids), pending)

    def forward(self, peer: bytes, msg: P.Message, pending: Pending) -> None:
        """Registers the request and sends it on under its engine-side id."""
        try:
            gid = self.routes.add(pending)
        except ValueError as exc:
            self.error(peer, pending.rid, P.BAD_REQUEST, str(exc))
            return
        if pending.kind != P.Health.TAG:  # health probes come many a second: not worth a line each
            logger.debug("request %r (%s): routed to engine id %s", pending.rid, pending.kind, gid)
        if not self.to_engine(peer, pending.rid, dataclasses.replace(msg, rid=gid)):
            self.routes.pop(gid)

    def to_engine(self, peer: bytes, rid: str, msg: P.Message) -> bool:
        try:
            self.to_engine_sock.send(P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.error(peer, rid, P.OVERLOADED, "the engine's queue is full; try again later")
            return False

    def drop_peer(self, peer: bytes | int) -> None:
        """A client went away: abort its generate requests, forget the rest."""
        dropped = self.routes.pop_peer(peer)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("client %s gone: dropping %d requests %s",
                         peer.hex() if isinstance(peer, bytes) else f"http-{peer}", len(dropped),
                         [pending.rid for _, pending in dropped])
        for gid, pending in dropped:
            if pending.kind == P.GenerateReq.TAG:
                self.to_engine(peer, pending.rid, P.Abort(rid=gid))

    # ---- from the engine ----
    def on_engine(self, frame: zmq.Frame) -> None:
        msg = P.decode(frame.bytes, max_bytes=1 << 62)  # trusted, and may be large
        if isinstance(msg, P.Heartbeat):
            return
        for item in msg.items if isinstance(msg, P.Batch) else [msg]:
            pending = self.routes.get(item.rid)
            if pending is None:  # its client is gone (the engine still says how it ended)
                if isinstance(item, P.Finished) and self.http is not None:
                    self.http.metrics.on_finished(item.finish_reason, item.meta)
                continue
            if isinstance(item, P.TokenChunk):
                text = self.text(pending, item.index).push(item.token_ids) if self.tokenizer else ""
                self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid, text=text))
            elif isinstance(item, P.Finished):
                self.on_finished(item, pending)
            elif isinstance(item, P.CacheTree):
                self.routes.pop(item.rid)
                self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid,
                                                             requests=self.described(item.requests)))
            else:  # an error, or the answer to a control request: the request's last word
                if isinstance(item, P.ErrorMsg):
                    logger.debug("request %r: the engine replied %s: %s", pending.rid, item.code,
                                 item.message)
                self.routes.pop(item.rid)
                self.reply(pending.peer, dataclasses.replace(item, rid=pending.rid))

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
            pending.texts[index] = TextStream.of(self.tokenizer, pending.params, pending.input_ids)
        return pending.texts[index]


def main(spec_json: str | None = None) -> int:
    spec = GatewaySpec(**json.loads(spec_json if spec_json is not None else sys.stdin.read()))
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
        preload_tokenizers()  # slow to import: do it while the engine loads
        ready = gateway.wait_engine(lambda: stop["now"] or parent.orphaned())
        if ready is None:
            if gateway.engine.exited():
                logger.error("the engine exited before it was ready")
                return EXIT_ENGINE_DEAD
            return 0
        gateway.open(ready)
        if gateway.http is not None:
            gateway.http.ready(ready, gateway.tokenizer)
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
