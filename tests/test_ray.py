"""Replicas placed by Ray (issue 20): a local Ray head on 127.0.0.1, two replicas of a tiny llama
placed on it as actors, one actor killed through Ray: its requests fail, the other replica
serves on, and Ray restarts it."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stemma
from stemma.serve.router import Routing
from tests.served import ENGINE, free_port, outcomes, replica_pids, wait_replaced
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'stemma[ray]'")

GREEDY = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True)
LONG = dict(temperature=0.0, max_new_tokens=1500, ignore_eos=True)
RAY = str(Path(sys.executable).parent / "ray")
STOP_WAIT_S = 5   # alone it stops in ~1.3 s; in full suites it has outlived 20 and 120 s


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("ray_llama"))
    return str(save_tiny_tokenizer(path))


@pytest.fixture(scope="module")
def ray_head():
    """The address of a Ray head of its own on 127.0.0.1: `ray start --head --block` in a process
    group of its own, which stops the processes it started when it is interrupted (`ray stop`
    would stop every Ray cluster of this user). Whatever of the group still runs STOP_WAIT_S
    after the interrupt, or is left behind, is killed with the group."""
    port = free_port()
    proc = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                             "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false",
                             "--disable-usage-stats", "--object-store-memory", str(100 << 20)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # no token to share
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert not _exited(proc), "ray start exited"
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        stop = time.monotonic() + STOP_WAIT_S
        while not _exited(proc) and time.monotonic() < stop:
            time.sleep(0.1)
        # the head is not reaped yet, so its pid still names only its own group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _exited(proc: subprocess.Popen) -> bool:
    """Whether `proc` has exited, leaving it unreaped."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def test_two_ray_placed_replicas_serve_and_ray_restarts_a_killed_one(folder, ray_head):
    with stemma.Runtime(folder, dp=2, ray=stemma.RayPlacement(ray_address=ray_head),
                        routing=Routing(router="round_robin"), start_timeout=300, **ENGINE) as rt:
        client = rt.client
        before = replica_pids(client)
        outs = [client.generate([5, 6, 9], GREEDY, timeout=60) for _ in range(2)]  # one on each
        assert outs[0].token_ids == outs[1].token_ids
        assert client.info()["stats"]["router"]["routed"] == [1, 1]
        streams = [client.stream([5, 6, 7 + i], LONG, timeout=60) for i in range(2)]  # 0, then 1
        assert all(isinstance(next(iter(s)), str) for s in streams)
        ray.init(address=ray_head, namespace="stemma", log_to_driver=False)
        try:
            actor = ray.get_actor(f"stemma-engine-{rt._procs.gateway.pid}-1")
            ray.kill(actor, no_restart=False)
            outcome = outcomes(streams)
            assert [o[0] for o in outcome] == ["done", "engine_dead"], outcome
            assert "replica 1" in outcome[1][1]
            assert client.generate([5, 6], GREEDY, timeout=60).token_ids  # replica 0 serves on
            pids = wait_replaced(client, before, 1, timeout=180)  # Ray restarted it
            assert pids[0] == before[0]
            again = [client.generate([5, 6, 9], GREEDY, timeout=60) for _ in range(2)]
            assert [o.token_ids for o in again] == [outs[0].token_ids] * 2
        finally:
            ray.shutdown()
