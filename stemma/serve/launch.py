"""`stemma serve`: a gateway process, which runs and supervises the engine process.

    serve ── python -m stemma.serve.gateway          (clients, tokenizer, detokenizer, router)
               └── python -m stemma.engine.process   (model, scheduler, radix cache), --dp of them

The two talk over ipc sockets in a private temporary folder. Each child gets its spec as JSON on
stdin (never on the command line, where the API key would show in `ps`); the engine's comes
inside the gateway's. The gateway restarts an engine that dies or hangs (serve.supervisor), within
its budget. SIGINT and SIGTERM stop the gateway, which tells waiting clients why and stops the
engine. If the gateway exits by itself (the engine died with no restart left), `serve` exits
with status 1. Each child also exits by itself when its parent disappears.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from stemma.engine_config import EngineConfig
from stemma.log import check_level
from stemma.protocol.messages import DEFAULT_MAX_FRAME_BYTES
from stemma.field_doc import doc
from stemma.serve.proc_watch import spawn_module, stop_child
from stemma.serve.ray_placement import RayPlacement
from stemma.serve.router import Routing
from stemma.serve.supervisor import Supervision

logger = logging.getLogger(__name__)

API_KEY_ENV = "STEMMA_API_KEY"
STOP_GRACE_S = 10.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeConfig:
    host: str = doc("127.0.0.1", "the address both ports listen on; any other exposes the server "
                                 "beyond this machine: set an API key then")
    port: int = doc(30000, "the HTTP port: the OpenAI-compatible API, stemma's own routes, "
                           "/metrics and /dashboard")
    zmq_port: int = doc(30001, "the ZeroMQ port: stemma's own protocol "
                               "(stemma.connect(\"tcp://host:port\"))")
    api_key: str | None = doc(None, f"a shared key every request must carry (HTTP: Authorization: "
                                    f"Bearer KEY); not given: ${API_KEY_ENV}, else none")
    max_frame_bytes: int = doc(DEFAULT_MAX_FRAME_BYTES, "the largest ZeroMQ message taken, and the "
                                                        "largest HTTP body")
    served_model_name: str | None = doc(None, "the model id of the OpenAI API; not given: the "
                                              "model's file or folder name")
    supervision: Supervision = field(default_factory=Supervision)  # engine restarts (own flags)
    dp: int = doc(1, "engine replicas (data parallel), each on its own share of the cores, "
                     "behind one gateway that routes each request to one of them")
    routing: Routing = field(default_factory=Routing)  # how requests are spread (own flags)
    ray: RayPlacement = field(default_factory=RayPlacement)  # Ray's placement of them (own flags)

    def __post_init__(self):
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        for name in ("port", "zmq_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [1, 65535], got {getattr(self, name)}")
        if self.port == self.zmq_port:
            raise ValueError(f"port and zmq_port must differ, both are {self.port}")
        if not self.host:
            raise ValueError("host must not be empty")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if not isinstance(self.supervision, Supervision):
            raise TypeError(f"supervision must be a Supervision, got {type(self.supervision).__name__}")
        if not isinstance(self.routing, Routing):
            raise TypeError(f"routing must be a Routing, got {type(self.routing).__name__}")
        if not isinstance(self.ray, RayPlacement):
            raise TypeError(f"ray must be a RayPlacement, got {type(self.ray).__name__}")

    @property
    def address(self) -> str:
        """The ZeroMQ address."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.zmq_port}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class ServerProcesses:
    """The gateway process of one server, which runs the engine process. `address` None: an ipc
    path of their own. `log_level` (one of stemma.log.LEVELS) is what both log at, on their
    stderr. `http` None: no HTTP front (`supervision` then says what to do when the engine dies)."""

    def __init__(self, engine: EngineConfig, address: str | None = None, api_key: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, log_level: str = "warning",
                 http: ServeConfig | None = None, supervision: Supervision | None = None,
                 dp: int | None = None, routing: Routing | None = None,
                 ray: RayPlacement | None = None):
        """`supervision`, `dp`, `routing` and `ray` (Ray's placement of the replicas) are taken
        from `http` when None."""
        log_level = check_level(log_level)
        supervision = supervision or (http.supervision if http is not None else Supervision())
        dp = dp or (http.dp if http is not None else 1)
        routing = routing or (http.routing if http is not None else Routing())
        ray = ray or (http.ray if http is not None else RayPlacement())
        self.folder = tempfile.mkdtemp(prefix="stemma-")  # mode 0700: only we reach the ipc paths
        self.address = address or f"ipc://{self.folder}/client"
        self.api_key = api_key
        self.gateway = spawn_module("stemma.serve.gateway", {
            "address": self.address, "requests": f"ipc://{self.folder}/requests",
            "outputs": f"ipc://{self.folder}/outputs", "engine": dataclasses.asdict(engine),
            "supervision": dataclasses.asdict(supervision), "api_key": api_key,
            "max_frame_bytes": max_frame_bytes, "log_level": log_level,
            "dp": dp, "routing": dataclasses.asdict(routing), "ray": dataclasses.asdict(ray),
            **({"http_host": http.host, "http_port": http.port,
                "served_model_name": http.served_model_name} if http is not None else {})})
        logger.debug("started the gateway (pid %d) for %s", self.gateway.pid, self.address)

    def exited(self) -> str | None:
        """How the gateway exited, or None while it runs (it outlives engine restarts)."""
        if self.gateway.poll() is not None:
            return f"the gateway process exited with status {self.gateway.returncode}"
        return None

    def wait_ready(self, timeout: float | None, stopping: Callable[[], bool] = lambda: False) -> bool:
        """Waits until the server answers health checks; False if told to stop first. Raises
        RuntimeError if a child exits first, TimeoutError after `timeout` seconds."""
        from stemma.client.sync import connect
        deadline = None if timeout is None else time.monotonic() + timeout
        with connect(self.address, self.api_key) as client:
            while not stopping():
                died = self.exited()
                if died:
                    raise RuntimeError(f"stemma server failed to start: {died}")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"stemma server not ready after {timeout:g} s")
                if client.health(timeout=0.5):
                    return True
        return False

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the gateway (which stops the engine); SIGKILL if it outlives `grace` (the
        engine then exits by itself, as its parent is gone)."""
        stop_child(self.gateway, grace)
        shutil.rmtree(self.folder, ignore_errors=True)


def check_free(host: str, port: int, what: str) -> None:
    """A RuntimeError naming `what` when nothing can listen at host:port (another server has it,
    or the host is no address of this machine). Another server answering there would otherwise
    pass for this one while its model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {what} at {host}:{port}: "
                               f"{exc.strerror or exc}") from None


def serve(engine: EngineConfig, config: ServeConfig, log_level: str = "info") -> int:
    """Runs a server until SIGINT/SIGTERM (status 0) or until the gateway exits (status 1: the
    engine died with no restart left, or the HTTP front failed). Its own
    messages go to the `stemma.serve.launch` logger (`stemma.log.configure` shows them, as the
    `stemma` command does); the children log at `log_level`."""
    api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
    if config.host not in LOOPBACK and api_key is None:
        logger.warning("serving on %s without an API key", config.host)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    try:  # the ZeroMQ port is bound once the model is loaded: a busy one fails here, at once
        check_free(config.host, config.zmq_port, "the ZeroMQ port")
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs = ServerProcesses(engine, config.address, api_key, config.max_frame_bytes, log_level,
                            http=config)
    try:
        try:
            if procs.wait_ready(None, lambda: stop["signal"] is not None):
                logger.info("serving %s: HTTP at %s (OpenAI API under /v1, /metrics, /dashboard), "
                            "ZeroMQ at %s", engine.model or "the default model", config.url,
                            config.address)
        except RuntimeError as exc:
            logger.error("%s", exc)
            return 1
        while stop["signal"] is None:
            died = procs.exited()
            if died:
                logger.error("%s; shutting down", died)
                return 1
            time.sleep(0.1)
        logger.debug("signal %d: stopping the server", stop["signal"])
        return 0
    finally:
        procs.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
