"""`stemma.Runtime`: a private server (a gateway child process, with its engine) for this program.

    with stemma.Runtime() as rt:                 # the default model
        print(rt.client.generate("Hello", {"max_new_tokens": 8}).text)

It listens on an ipc path in a private temporary folder, so nothing else on the machine can reach
it. The children stop on `close()`, on leaving the `with` block, at interpreter exit, and by
themselves if this process dies.
"""
from __future__ import annotations

import atexit
from typing import Any

from stemma.client.sync import Client, connect
from stemma.engine_config import EngineConfig
from stemma.serve.launch import ServerProcesses
from stemma.serve.ray_placement import RayPlacement
from stemma.serve.router import Routing
from stemma.serve.supervisor import Supervision


class Runtime:
    def __init__(self, model: str | None = None, *, start_timeout: float | None = 600.0,
                 log_level: str = "warning", supervision: Supervision | None = None,
                 dp: int = 1, routing: Routing | None = None, ray: RayPlacement | None = None,
                 model_path: str | None = None, **engine_config: Any):
        """`engine_config` takes the fields of EngineConfig, as Engine does; they are checked here,
        before any process starts. `log_level` (one of stemma.log.LEVELS) is what the two
        children log at, on this process's stderr. `supervision`: engine restarts, as
        `stemma serve` does them (its defaults when None). `dp` engine replicas, each on its
        own share of the cores, behind one gateway that routes by `routing` (its defaults when
        None: cache-aware). `ray`: place the replicas as Ray actors on a cluster, as `stemma serve
        --ray-address` does (None: no Ray). `model_path`: SGLang's name for `model`."""
        if model_path is not None:
            if model is not None:
                raise ValueError("give the model once: model or model_path (SGLang's name for it)")
            model = model_path
        config = EngineConfig.from_kwargs(model=model, **engine_config)
        if dp < 1:
            raise ValueError(f"dp must be >= 1, got {dp}")
        self._procs: ServerProcesses | None = ServerProcesses(config, log_level=log_level,
                                                              supervision=supervision, dp=dp,
                                                              routing=routing, ray=ray)
        atexit.register(self.close)
        try:
            self._procs.wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self.address = self._procs.address
        self.client: Client = connect(self.address)

    @property
    def pid(self) -> int | None:
        """The gateway process's pid (the engine processes are its children); None once closed."""
        return self._procs.gateway.pid if self._procs is not None else None

    @property
    def running(self) -> bool:
        return self._procs is not None and self._procs.exited() is None

    def close(self) -> None:
        if self._procs is None:
            return
        if hasattr(self, "client"):
            self.client.close()
        self._procs.stop()
        self._procs = None
        atexit.unregister(self.close)

    def shutdown(self) -> None:
        """SGLang's name for close()."""
        self.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
