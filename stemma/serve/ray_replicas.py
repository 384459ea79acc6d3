"""Engine replicas placed by Ray (`stemma serve --dp N --ray-address ADDR`; `pip install 'stemma[ray]'`).

    gateway ── ray.init(ADDR) ── EngineActor i (num_cpus / num_gpus, max_restarts=-1)
       ▲                              └── python -m stemma.engine.process   (its child)
       └──────────── ZeroMQ over tcp (the gateway's node address) ─────────────┘

Each replica is a Ray actor with the resource request of --ray-num-cpus / --ray-num-gpus, placed
by Ray on any node of the cluster. The actor runs the ordinary engine process as its child and
lives exactly as long as it: when the engine exits, the actor exits too, and Ray restarts the
actor (and with it a fresh engine), without limit. The engine connects to the gateway's
sockets, bound on the gateway node's address (not loopback: the actors may be elsewhere; the
cluster's network is the trust boundary, as Ray's own is).

`RaySupervisor` stands in for serve.supervisor.Supervisor on the gateway side. Ray does the
restarting, so it only notices deaths: a ping to the actor (one in flight, checked at every
`dead()` call) that fails, or that answers with another engine pid than the one that said it was
ready; a ready engine silent for --engine-timeout seconds (hung) is killed through Ray, which
restarts it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from stemma.serve.proc_watch import spawn_module, stop_child
from stemma.serve.ray_placement import RayPlacement
from stemma.serve.supervisor import ENGINE_MODULE, STOP_GRACE_S, Supervision

NAMESPACE = "stemma"
PING_PERIOD_S = 0.5

logger = logging.getLogger("stemma.serve.ray_replicas")


class EngineActor:
    """The Ray actor of one replica (made remote by `actor_class`): its engine process's parent."""

    def __init__(self, spec: dict[str, Any]):
        self.proc = spawn_module(ENGINE_MODULE, spec)
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        self.proc.wait()
        os._exit(1)  # the actor dies with its engine, so that Ray restarts both

    def pid(self) -> int:
        """The engine process's pid."""
        return self.proc.pid

    def stop(self) -> None:
        stop_child(self.proc, STOP_GRACE_S)


def connect(address: str) -> Any:
    """Joins the Ray cluster at `address` (imported here: Ray is an optional extra)."""
    try:
        import ray
    except ImportError:
        raise ImportError("--ray-address needs Ray: pip install 'stemma[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING)
    return ray


def node_address() -> str:
    """The address the actors reach this (the gateway's) node at."""
    import ray
    return ray.util.get_node_ip_address()


class RaySupervisor:
    """One replica's actor, as the gateway's Supervisor interface sees it (see the module doc)."""

    fd = None  # no pidfd: deaths are noticed by ping

    def __init__(self, spec: dict[str, Any], policy: Supervision, name: str, placement: RayPlacement,
                 clock: Callable[[], float] = time.monotonic):
        self.spec, self.policy, self.name, self.clock = spec, policy, name, clock
        self.placement = placement
        self.actor: Any = None
        self.cause: str | None = None
        self.ready = False
        self.last_heard = 0.0
        self.starts = 0
        self.engine_pid: int | None = None   # the engine that said it was ready
        self._ping: Any = None
        self._next_ping = 0.0

    @property
    def pid(self) -> int | None:
        return self.engine_pid

    def start(self) -> None:
        """Creates the actor the first time; after a death, Ray is already restarting it."""
        import ray
        if self.actor is None:
            remote = ray.remote(num_cpus=self.placement.ray_num_cpus, num_gpus=self.placement.ray_num_gpus,
                                max_restarts=-1, max_task_retries=0)(EngineActor)
            self.actor = remote.options(name=self.name, lifetime="non_detached").remote(self.spec)
        self.cause, self.ready, self.starts = None, False, self.starts + 1
        self._ping, self._next_ping = None, 0.0

    def on_ready(self, pid: int | None = None) -> None:
        self.ready = True
        self.last_heard = self.clock()
        if pid is not None:
            self.engine_pid = pid

    def heard(self) -> None:
        self.last_heard = self.clock()

    def replaced(self, old: int | None, new: int) -> None:
        """An engine with another pid said it was ready: the one that served is gone."""
        if self.cause is None:
            self.cause = (f"the engine process (pid {old}) died; Ray restarted its actor, whose "
                          f"engine (pid {new}) is ready")

    def dead(self) -> str | None:
        if self.cause is not None or self.actor is None:
            return self.cause
        import ray
        if self._ping is not None:
            done, _ = ray.wait([self._ping], timeout=0)
            if done:
                ping, self._ping = self._ping, None
                try:
                    pid = ray.get(ping)
                    if self.ready and self.engine_pid is not None and pid != self.engine_pid:
                        self.cause = f"the engine process (pid {self.engine_pid}) died"
                except ray.exceptions.RayActorError as exc:
                    if self.ready:
                        self.cause = (f"its Ray actor died ({type(exc).__name__}); Ray is "
                                      f"restarting it")
        if self.cause is None and self._ping is None and self.clock() >= self._next_ping:
            self._ping, self._next_ping = self.actor.pid.remote(), self.clock() + PING_PERIOD_S
        if self.cause is None and self.ready and \
                self.clock() - self.last_heard > self.policy.engine_timeout:
            ray.kill(self.actor, no_restart=False)
            self.cause = (f"the engine sent no heartbeat for {self.clock() - self.last_heard:.1f} "
                          f"s (the limit is --engine-timeout {self.policy.engine_timeout:g} s): "
                          f"taken for hung, its actor killed for Ray to restart")
        return self.cause

    def may_restart(self, last: bool = True) -> tuple[bool, str]:
        return True, "Ray restarts it; retry shortly"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        if self.actor is not None:
            import ray
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # the cluster may be gone already
                logger.debug("could not kill the actor of %s", self.name, exc_info=True)
            self.actor = None
