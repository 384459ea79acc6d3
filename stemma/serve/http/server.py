"""uvicorn on a thread of the gateway process, serving the HTTP app (see bridge for how it
reaches the gateway loop). Signals stay with the gateway's main thread."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import uvicorn

from stemma.serve.http.app import make_app
from stemma.serve.http.state import HttpState

logger = logging.getLogger("stemma.serve.http")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


class HttpServer:
    def __init__(self, state: HttpState, host: str, port: int):
        config = uvicorn.Config(make_app(state), host=host, port=port, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.state = state
        self.thread = threading.Thread(target=self._run, name="stemma-http", daemon=True)
        self.failed: BaseException | None = None

    def _run(self) -> None:
        try:  # uvicorn's loop choice: uvloop when installed
            with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
                runner.run(self._serve())
        except BaseException as exc:  # uvicorn exits (SystemExit) when it cannot bind
            self.failed = exc

    async def _serve(self) -> None:
        self.state.bridge.loop = asyncio.get_running_loop()
        await self.server.serve()

    def start(self) -> None:
        """Returns once the port listens; raises RuntimeError if it cannot."""
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server could not listen on "
                                   f"{self.server.config.host}:{self.server.config.port}")
            time.sleep(0.01)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)
