"""`stemma repl`: plain prompts and text programs, streamed, with variables kept between inputs.

    stemma> The capital of France is                 a plain prompt: its continuation streams
    stemma> Q: {_} A:{gen answer max_tokens=16}      a text program; {_} is the last continuation
    stemma> :vars | :stats | :reset | :set name=value | :help | :quit

A line ending in a backslash continues on the next line; `\\n` and the other escapes of
lang/escapes.py are read, as in .stm text. Every input is its own program, so inputs that repeat
an earlier prefix are served from the prefix cache (see :stats). The history is kept in
~/.stemma_history (--history sets another file; an empty path keeps none).

The banner and the prompt come at once: the backend (a model that may take a minute to load) is
made on a background thread (`load_in_background`), and the first input waits for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, TextIO

from stemma.lang.backends.base import Backend
from stemma.lang.errors import ProgramError, UnknownVariable
from stemma.lang.escapes import unescape
from stemma.lang.interpreter import Value
from stemma.lang.ir import Gen, Select
from stemma.lang.stm import compile_text
from stemma.lang.usage import Usage
from stemma.sampling_params import SamplingParams

HELP = """\
  <text>            continue the text on the model (stored in {_})
  <text with holes> run it as a text program: {gen x ...}, {select x choices=[...]}, {var}
  :vars             the variables so far        :set name=value   set one
  :stats            the engine's cache hit rate, tokens/s, running requests
  :reset            forget the variables and this session's counters
  :help  :quit      (a line ending in \\ continues on the next line)"""
LAST = "_"
BANNER = ("stemma repl: a plain prompt continues the text; holes make a text program. "
          ":help lists the commands.")


def default_history() -> str:
    return os.environ.get("STEMMA_HISTORY", str(Path.home() / ".stemma_history"))


def load_in_background(make: Callable[[], Backend], announce: Callable[[str], None]) -> Future:
    """A Future of `make()`, run on a daemon thread (a process that quits while a model loads
    does not wait for it; the runtime's processes watch their parent). `announce` gets one line
    when it is done: the model is ready, or why it did not load."""
    future: Future = Future()
    started = time.perf_counter()

    def load() -> None:
        try:
            future.set_result(make())
        except BaseException as exc:  # handed to whoever waits for the backend
            future.set_exception(exc)
            announce(f"error: the model did not load: {exc}")
            return
        announce(f"model ready ({time.perf_counter() - started:.1f} s)")

    threading.Thread(target=load, name="stemma-repl-load", daemon=True).start()
    return future


class Repl:
    def __init__(self, backend: Backend | Future, sampling: dict[str, Any] | None = None,
                 out: TextIO | None = None):
        """`backend`: a Backend, or a Future of one (still loading: see load_in_background)."""
        import sys
        self._backend = backend
        self.sampling = dict(sampling or {})
        SamplingParams.from_dict(self.sampling)
        self.out = out or sys.stdout
        self.vars: dict[str, Value] = {}
        self.usage = Usage()

    @property
    def loading(self) -> bool:
        return isinstance(self._backend, Future) and not self._backend.done()

    @property
    def backend(self) -> Backend:
        """The backend, once it is ready: a Future is waited for here (its error raised)."""
        if isinstance(self._backend, Future):
            if self.loading:
                self.write("(waiting for the model to load ...)\n")
            self._backend = self._backend.result()
        return self._backend

    def close(self) -> None:
        """Closes the backend if it loaded (one still loading is left to go with the process)."""
        backend = self._backend
        if isinstance(backend, Future):
            if not backend.done() or backend.exception() is not None:
                return
            backend = backend.result()
        backend.close()

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    # ---- one input ----
    def execute(self, line: str) -> bool:
        """Runs one input; False once the user asked to quit."""
        line = line.strip("\n")
        if not line.strip():
            return True
        try:
            if line.startswith(":"):
                return self.command(line[1:].strip())
            self.program(line)
        except KeyboardInterrupt:  # while the model loads, say (a stream stops in program())
            self.write("\n[interrupted]\n")
        except (ProgramError, ValueError, TypeError, ConnectionError) as exc:
            self.write(f"error: {exc}\n")
        except Exception as exc:  # a failed input is reported; the session goes on
            self.write(f"error: {type(exc).__name__}: {exc}\n")
        return True

    def program(self, source: str) -> None:
        fn = compile_text(source, "<input>")
        plain = not any(isinstance(n, (Gen, Select)) for n in fn.nodes)
        if plain:
            fn = compile_text(source + "{gen " + LAST + "}", "<input>")
        for name, where in fn.arguments.items():
            if name not in self.vars:
                raise UnknownVariable(name, where, list(self.vars), "`:set name=value` sets one")
        args = {name: self.vars[name] for name in fn.arguments}
        state = fn.run(backend=self.backend, sampling=self.sampling, stream=True, **args)
        try:
            for delta in state.text_iter(generated_only=plain):
                self.write(delta)
        except KeyboardInterrupt:
            state.cancel()
            self.write("\n[interrupted]\n")
            return
        self.write("\n")
        self.vars.update(state.vars())
        self.usage = self.usage + state.usage()

    # ---- commands ----
    def command(self, text: str) -> bool:
        name, _, rest = text.partition(" ")
        actions: dict[str, Callable[[str], None]] = {
            "vars": self.show_vars, "stats": self.show_stats, "reset": self.reset,
            "set": self.set_var, "help": lambda _: self.write(HELP + "\n")}
        if name in ("quit", "q", "exit"):
            return False
        if name not in actions:
            self.write(f"unknown command :{name} (try :help)\n")
            return True
        actions[name](rest.strip())
        return True

    def show_vars(self, _: str = "") -> None:
        if not self.vars:
            self.write("(no variables)\n")
        for name, value in self.vars.items():
            text = repr(value)
            self.write(f"{name} = {text if len(text) <= 200 else text[:197] + '...'}\n")

    def show_stats(self, _: str = "") -> None:
        stats = asyncio.run(self.backend.stats())
        self.write(f"cache hit rate {stats.get('cache_hit_rate', 0.0):.1%} | "
                   f"{stats.get('tokens_per_s', 0.0):.1f} tokens/s | "
                   f"running {stats.get('running', 0)} | queued {stats.get('queue', 0)} | "
                   f"prompt tokens {stats.get('prompt_tokens', 0)} "
                   f"(cached {stats.get('cached_tokens', 0)}) | "
                   f"generated {stats.get('generated_tokens', 0)}\n"
                   f"this session: {self.usage}\n")

    def reset(self, _: str = "") -> None:
        self.vars.clear()
        self.usage = Usage()
        self.write("variables and session counters cleared\n")

    def set_var(self, text: str) -> None:
        name, eq, value = text.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            self.write("usage: :set name=value\n")
            return
        self.vars[name] = unescape(value)
        self.write(f"{name} = {self.vars[name]!r}\n")


def run_repl(make_backend: Callable[[], Backend], sampling: dict[str, Any] | None = None,
             history: str | None = None) -> int:
    """The interactive loop, with prompt_toolkit's line editing and history. The banner comes
    first; the backend is made meanwhile (`load_in_background`) and closed at the end."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.patch_stdout import patch_stdout
    path = default_history() if history is None else history
    if path and not _writable(path):
        print(f"stemma: warning: cannot write the history file {path}; this session's history is "
              "kept in memory only", file=sys.stderr)
        path = None
    interactive = sys.stdin.isatty()
    session = (PromptSession(history=FileHistory(path) if path else InMemoryHistory()) if interactive
               else LineInput(sys.stdin))
    print(BANNER, flush=True)
    repl = Repl(load_in_background(make_backend, _say), sampling)
    if repl.loading:
        repl.write("loading the model in the background (up to a minute the first time); you "
                   "can type now: your first input runs once it is ready\n")
    try:
        # the loader's "model ready" line prints above the prompt
        with patch_stdout(raw=True) if interactive else contextlib.nullcontext():
            return _loop(repl, session)
    finally:
        repl.close()


class LineInput:
    """Inputs read from a stdin that is no terminal (a file, a pipe), each echoed after its
    prompt as a terminal would show it: prompt_toolkit reads EOF at once from a regular file."""

    def __init__(self, stream):
        self.stream = stream

    def prompt(self, text: str) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        line = line.rstrip("\r\n")
        _say(text + line)
        return line


def _say(line: str) -> None:
    """One line in one write: print() writes its end apart, and the loader's thread prints too."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _writable(path: str) -> bool:
    """Whether the history file can be appended to (prompt_toolkit failed on every input else)."""
    try:
        with open(path, "ab"):
            return True
    except OSError:
        return False


def _loop(repl: Repl, session) -> int:
    while True:
        try:
            line = session.prompt("stemma> ")
            while line.endswith("\\"):
                line = line[:-1] + "\n" + session.prompt("....... ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return 0
        if not repl.execute(line):
            return 0
