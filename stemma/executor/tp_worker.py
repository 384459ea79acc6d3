"""A worker rank of a tensor-parallel engine (see executor.tensor_parallel): loads its slice of
the model and a KV pool for its KV heads, joins the process group, then runs each forward rank 0
sends it, until its stdin closes. Run as `python -m stemma.executor.tp_worker`, its spec as the
first frame on stdin."""
from __future__ import annotations

import json
import sys

import stemma.engine.threads  # noqa: F401  (OpenMP settings, before torch)
import torch
import torch.distributed as dist

from stemma.executor import tuning
from stemma.executor.runner import ModelRunner, RunnerConfig
from stemma.executor.step_frame import unpack
from stemma.executor.tensor_parallel import process_group, read_frame, worker_threads
from stemma.loader.model import load_model
from stemma.models.parallel import TensorParallel


def main() -> int:
    spec = json.loads(read_frame(sys.stdin.buffer))
    rank, size, device = spec["rank"], spec["size"], torch.device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(worker_threads(size))
    else:
        torch.cuda.set_device(device)
    tp = TensorParallel(rank, size, None)
    loaded = load_model(device=device, tp=tp, **spec["model"])
    tuning.tune(loaded.model)
    runner = ModelRunner(loaded, RunnerConfig(**spec["runner"], compile_decode="off"))
    store = dist.FileStore(spec["store"], size)
    store.set(f"loaded/{rank}", "1")
    tp.group = process_group(store, rank, size, device)
    while True:
        frame = read_frame(sys.stdin.buffer)
        if not frame:
            return 0
        runner.forward(unpack(frame, device))


if __name__ == "__main__":
    sys.exit(main())
