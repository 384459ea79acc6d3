"""`stemma repl`: plain prompts and text programs, streamed, with variables kept between inputs.

    stemma> The capital of France is                 a plain prompt: its continuation streams
    stemma> Q: {_} A:{gen answer max_tokens=16}      a text program; {_} is the last continuation
    stemma> :vars | :stats | :reset | :set name=value | :help | :quit

A line ending in a backslash continues on the next line. Every input is its own program, so
inputs that repeat an earlier prefix are served from the prefix cache (see :stats). The history
is kept in ~/.stemma_history (--history sets another file; an empty path keeps none).
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Callable, TextIO

from stemma.lang.backends.base import Backend
from stemma.lang.errors import ProgramError
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


def default_history() -> str:
    return os.environ.get("STEMMA_HISTORY", str(Path.home() / ".stemma_history"))


class Repl:
    def __init__(self, backend: Backend, sampling: dict[str, Any] | None = None,
                 out: TextIO | None = None):
        import sys
        self.backend = backend
        self.sampling = dict(sampling or {})
        SamplingParams.from_dict(self.sampling)
        self.out = out or sys.stdout
        self.vars: dict[str, Value] = {}
        self.usage = Usage()

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    # ---- one input ----
    def execute(self, line: str) -> bool:
        """Runs one input; False once the user asked to quit."""
        line = line.strip("\n")
        if not line.strip():
            return True
        if line.startswith(":"):
            return self.command(line[1:].strip())
        try:
            self.program(line)
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
        args = {name: self.vars[name] for name in fn.arguments if name in self.vars}
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
        self.vars[name] = value
        self.write(f"{name} = {value!r}\n")


def run_repl(repl: Repl, history: str | None = None) -> int:
    """The interactive loop, with prompt_toolkit's line editing and history."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    path = default_history() if history is None else history
    session = PromptSession(history=FileHistory(path) if path else InMemoryHistory())
    repl.write("stemma repl: a plain prompt continues the text; holes make a text program. "
               ":help lists the commands.\n")
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
