"""Progress of the long waits (a cold model load above all): one log line as each stage begins,
with the seconds since this process started, so a slow stage is never silent.

    stemma: [  0.0s] loading the default model (Gemma 3 270M)
    stemma: [  2.3s] first load of gemma-3-270m.gguf: parsing its GGUF header once (30-50 s) ...
    stemma: [ 38.1s] reading 236 tensors of gemma-3-270m.gguf

Lines go to the caller's logger at info level (shown by `stemma generate` and `stemma serve`,
whose --log-level is info by default). Torch-free, so a command can announce a stage before
it imports torch.
"""
from __future__ import annotations

import logging
import os
import time

try:  # the process's start, from its age where the platform gives it (Linux); else this import
    with open("/proc/self/stat") as _stat:
        _TICKS = int(_stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as _uptime:
        _BOOTED_AGO = float(_uptime.read().split()[0])
    _START = time.monotonic() - (_BOOTED_AGO - _TICKS / os.sysconf("SC_CLK_TCK"))
except (OSError, ValueError, IndexError):
    _START = time.monotonic()


def elapsed() -> float:
    """Seconds since this process started."""
    return time.monotonic() - _START


def stage(logger: logging.Logger, message: str, *args: object) -> None:
    """Announces the stage that begins now (`message % args`), stamped with elapsed()."""
    logger.info("[%5.1fs] " + message, elapsed(), *args)
