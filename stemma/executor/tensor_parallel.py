"""A tensor-parallel engine (`tp` > 1): rank 0 is the engine's own process, which schedules; ranks
1..tp-1 are worker processes (`python -m stemma.executor.tp_worker`) that follow its forwards.

    rank 0: Engine ── ModelRunner.forward(fb) ── step frame (stdin pipe) ──▶ rank k: forward(fb)
              └──────────── collectives inside the forward (models.parallel) ───────┘

Rendezvous is a FileStore in a folder of rank 0's that only its user can open (a TCPStore listens
on every interface, whatever host it is given, and has no authentication); every rank loads its
own slice of the model, says so in the store, and only then joins the process group (gloo on CPU,
its connections on 127.0.0.1; NCCL on CUDA, rank k on cuda:k), so a rank that fails to load is an
error at once, not a hang. Each forward,
rank 0 writes the batch (executor.step_frame) to every worker's stdin, then runs its own slice;
the ranks meet in the forward's all-reduces and all-gathers, and rank 0 alone gets the logits.
A worker exits when its stdin closes (rank 0 stopped or died) or on an empty frame.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from stemma.executor.forward_batch import ForwardBatch
from stemma.executor.step_frame import pack
from stemma.models.parallel import TensorParallel

WORKER_MODULE = "stemma.executor.tp_worker"
TIMEOUT = datetime.timedelta(minutes=10)   # a collective that waits longer is an error
JOIN_POLL_S = 0.05


def write_frame(pipe: BinaryIO, payload: bytes) -> None:
    pipe.write(struct.pack("<Q", len(payload)))
    pipe.write(payload)
    pipe.flush()


def read_frame(pipe: BinaryIO) -> bytes | None:
    """The next frame; None at the end of the pipe."""
    head = pipe.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pipe.read(size)


def process_group(store: Any, rank: int, size: int, device: torch.device) -> Any:
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # loopback only
    options._timeout = TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Workers:
    """Ranks 1..size-1 of a tensor-parallel engine. `model` holds the fields a rank loads with
    (model, dtype, quantization, int4_group_size) and `runner` the KV pool's (RunnerConfig's)."""

    def __init__(self, size: int, device: torch.device, model: dict[str, Any], runner: dict[str, Any]):
        self.size, self.device = size, device
        self.folder = tempfile.mkdtemp(prefix="stemma-tp-")  # mode 0700
        store_path = os.path.join(self.folder, "store")
        self.store = dist.FileStore(store_path, size)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE)
            write_frame(proc.stdin, json.dumps({
                "rank": rank, "size": size, "store": store_path,
                "device": str(rank_device(device, rank)), "model": model, "runner": runner}).encode())
            self.procs.append(proc)
        self.tp = TensorParallel(0, size, None)  # its group once every rank has loaded (join)

    def join(self) -> None:
        """Waits until every worker has loaded its slice, then forms the process group."""
        keys = [f"loaded/{rank}" for rank in range(1, self.size)]
        while not self.store.check(keys):
            self.raise_if_dead()
            time.sleep(JOIN_POLL_S)
        self.tp.group = process_group(self.store, 0, self.size, self.device)

    def send(self, fb: ForwardBatch) -> None:
        """Has every worker run the forward of `fb` (called just before rank 0 runs its own)."""
        frame = pack(fb)
        for proc in self.procs:
            try:
                write_frame(proc.stdin, frame)
            except (BrokenPipeError, OSError):
                self.raise_if_dead()
                raise

    def raise_if_dead(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with "
                                   f"status {proc.returncode}")

    def close(self) -> None:
        for proc in self.procs:
            try:
                write_frame(proc.stdin, b"")
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        shutil.rmtree(self.folder, ignore_errors=True)


def worker_threads(size: int) -> int:
    """A CPU rank's share of this process's cores."""
    return max(1, len(os.sched_getaffinity(0)) // size)
