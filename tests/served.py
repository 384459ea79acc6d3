"""`stemma serve` as a real subprocess for the server tests, and the process helpers they share."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2

ENGINE = dict(dtype="float32", attention_backend="torch", kv_pool_tokens=8192, max_running_requests=64)
START_TIMEOUT_S = 180


@contextlib.contextmanager
def raw_dealer(address: str):
    """A bare ZeroMQ DEALER at `address`, on a context of its own, for sending hand-made frames."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (all bound at once while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: serve's gateway, and the gateway's engine."""
    return [p for c in children(pid) for p in (c, *descendants(c))]


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def engine_flags(**overrides) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE, **overrides}.items()]


class HttpServed:
    """`stemma serve --model folder` with HTTP on `port` (`url`) and ZeroMQ on `zmq_port`
    (`address`), ready once `GET /health` answers 200. `extra`: more `stemma serve` flags."""

    def __init__(self, folder: str, *extra: str, engine: dict | None = None, cwd: str | None = None):
        self.port, self.zmq_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.address = f"tcp://127.0.0.1:{self.zmq_port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stemma", "serve", "--model", folder, "--port", str(self.port),
             "--zmq-port", str(self.zmq_port), *engine_flags(**(engine or {})), *extra], cwd=cwd)
        deadline = time.monotonic() + START_TIMEOUT_S
        self.health_seen: list[int] = []  # the statuses /health answered while starting
        while True:
            assert self.proc.poll() is None, "serve exited during startup"
            assert time.monotonic() < deadline, "serve did not become healthy"
            try:
                response = httpx2.get(self.url + "/health", timeout=1)
            except httpx2.TransportError:
                time.sleep(0.05)
                continue
            self.health_seen.append(response.status_code)
            if response.status_code == 200:
                break
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            time.sleep(0.05)
        self.children = descendants(self.proc.pid)  # the gateway and its engine

    def stop(self) -> int:
        """SIGINT (a clean shutdown); returns serve's exit status, killing what outlives 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for pid in self.children:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


# ---- replicas (serve --dp) ----
def replica_pids(client) -> list[int]:
    """The engine pid of each replica, from the merged stats."""
    return [r["pid"] for r in client.info(timeout=10)["stats"]["replicas"]]


def outcomes(streams) -> list[tuple[str, object]]:
    """Each stream read to its end: ("done", characters) or (error code, message)."""
    from stemma.client.core import ServerError
    out = []
    for stream in streams:
        try:
            out.append(("done", len("".join(stream))))
        except ServerError as exc:
            out.append((exc.code, str(exc)))
    return out


def wait_replaced(client, before: list[int], index: int, timeout: float) -> list[int]:
    """Waits until replica `index` serves again with another engine pid; returns the pids."""
    from stemma.client.core import ServerError
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ServerError, TimeoutError):
            pids = replica_pids(client)
            if len(pids) == len(before) and pids[index] != before[index]:
                return pids
        assert time.monotonic() < deadline, f"replica {index} did not come back"
        time.sleep(0.2)
