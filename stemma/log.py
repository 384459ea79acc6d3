"""The `stemma` logger hierarchy, and the one place that configures it.

Every module logs to `logging.getLogger(__name__)` (stemma.serve.gateway, stemma.engine.process,
...). Nothing in stemma configures logging on import: a program that embeds stemma sees its
records through its own logging setup, and Python's last-resort handler shows warnings and errors
if it has none. Entry points (the `stemma` command and the server's child processes) call
`configure` once:

    stemma: serving /models/x at tcp://127.0.0.1:30000        (info and above)
    stemma: warning: serving on 0.0.0.0 without an API key
    12:00:01.234 stemma.serve.gateway debug: request r1 received: 7 prompt tokens, stream=False

This module imports nothing heavy (no torch), so any process may call it first thing.
"""
from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
ROOT = "stemma"


def check_level(level: str) -> str:
    """`level`, lower-cased, if it is one of LEVELS; ValueError otherwise."""
    name = str(level).lower()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}; got {level!r}")
    return name


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (it may be replaced later)."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


class _Formatter(logging.Formatter):
    """`prefix: message` for info, `prefix: warning: message` from warnings up; with the time, the
    logger name and the level when debugging."""

    def __init__(self, prefix: str, debug: bool):
        super().__init__(datefmt="%H:%M:%S")
        self.prefix = prefix
        self.debug = debug

    def formatMessage(self, record: logging.LogRecord) -> str:
        level = record.levelname.lower()
        if self.debug:
            return f"{record.asctime}.{int(record.msecs):03d} {record.name} {level}: {record.message}"
        if record.levelno >= logging.WARNING:
            return f"{self.prefix}: {level}: {record.message}"
        return f"{self.prefix}: {record.message}"

    def usesTime(self) -> bool:
        return self.debug


def configure(level: str = "info", *, prefix: str = "stemma") -> logging.Logger:
    """Sends the `stemma` loggers' records at `level` and above to stderr, through one handler of
    ours (calling again changes the level and prefix, and adds no second handler). `prefix` names
    the process in plain messages ("stemma", "stemma engine", ...). Returns the `stemma` logger."""
    name = check_level(level)
    root = logging.getLogger(ROOT)
    handler = next((h for h in root.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        root.addHandler(handler)
    handler.setFormatter(_Formatter(prefix, debug=name == "debug"))
    root.setLevel(getattr(logging, name.upper()))
    return root  # records still propagate: handlers on the root logger (if any) see them too
