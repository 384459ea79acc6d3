"""`stemma repl`, driven through a pseudo-terminal on the mock backend, and its commands."""
import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from stemma.lang.backends.mock import MockBackend
from stemma.lang.repl import Repl

DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0}  # stemma repl's sampling defaults
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


class Terminal:
    """A child process on a pseudo-terminal; `expect` reads until a pattern shows."""

    def __init__(self, argv, env):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     close_fds=True)
        os.close(slave)
        self.seen = ""

    def send(self, text):
        os.write(self.master, text.encode())

    def expect(self, pattern, timeout=30.0):
        """The output up to and including `pattern` (a regex), consumed."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.seen)
            if match:
                out, self.seen = self.seen[:match.end()], self.seen[match.end():]
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout} s; got {self.seen[-2000:]!r}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    chunk = ""
                if not chunk and self.proc.poll() is not None:
                    raise AssertionError(f"the repl exited; output: {self.seen[-2000:]!r}")
                self.seen += ANSI.sub("", chunk)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200",
           "LINES": "50"}
    term = Terminal([sys.executable, "-m", "stemma", "repl", "--backend", "mock",
                     "--history", str(tmp_path / "history")], env)
    yield term
    term.close()


def expected_vars(*inputs):
    repl = Repl(MockBackend(), DEFAULTS, out=io.StringIO())
    for line in inputs:
        repl.execute(line)
    return repl.vars


PROMPT = r"stemma>$"  # a fresh prompt ends the output (the echo of an input has text after it)


def test_repl_through_a_pseudo_terminal(terminal, tmp_path):
    first, second = "Hello there", "Q: {_} A:{gen answer max_tokens=8}"
    want = expected_vars(first, second)

    def enter(line, *patterns):
        terminal.send(line + "\r")
        outs = [terminal.expect(p) for p in patterns]
        terminal.expect(PROMPT)
        return outs

    terminal.expect(PROMPT)
    enter(first, re.escape(want["_"].strip()))  # a plain prompt: its continuation streams
    enter(second, re.escape(f"Q: {want['_']} A:{want['answer']}"))  # a text program: its text
    enter(":vars", re.escape(f"_ = {want['_']!r}"), re.escape(f"answer = {want['answer']!r}"))
    enter(":stats", r"cache hit rate \d+\.\d% \| [\d.]+ tokens/s \| running 0 \| queued 0",
          r"this session: 2 model calls")
    terminal.send("\x1b[A\x1b[A\x1b[A")  # history: three up is the text program again
    enter("", re.escape(f"A:{want['answer']}"))
    enter(":reset", "variables and session counters cleared")
    enter(":vars", re.escape("(no variables)"))
    enter("{nothing}", re.escape("unknown variable {nothing}"))
    terminal.send("multi \\\r")
    terminal.expect(r"\.\.\.\.\.\.\.")
    enter("line{gen x max_tokens=3}", "multi \nline")
    terminal.send(":quit\r")
    assert terminal.proc.wait(20) == 0
    history = (tmp_path / "history").read_text()
    assert "+Hello there" in history and "+:stats" in history


def test_repl_commands():
    out = io.StringIO()
    repl = Repl(MockBackend(), DEFAULTS, out=out)
    assert repl.execute(":set topic=the sea")
    assert repl.execute("Write about {topic}:{gen poem max_tokens=10}")
    assert repl.vars["topic"] == "the sea" and len(repl.vars["poem"]) == 10
    assert repl.execute(":nope")
    assert repl.execute("{gen a max_tokns=1}")
    text = out.getvalue()
    assert "Write about the sea:" in text and "unknown command :nope" in text
    assert "error: <input>:1:1: gen: unknown SamplingParams fields: max_tokns" in text
    assert repl.execute(":quit") is False


def test_a_failing_command_or_an_interrupt_leaves_the_session_going():
    """:stats with a backend that failed to load ended the REPL (the error went up to main), and
    Ctrl-C while the model loaded killed it with a traceback."""
    from concurrent.futures import Future

    class Interrupting(MockBackend):
        def __init__(self):
            super().__init__()
            self.left = 1

        async def stats(self):
            if self.left:
                self.left -= 1
                raise KeyboardInterrupt
            return await super().stats()

    failed: Future = Future()
    failed.set_exception(ValueError("model path '/nope.gguf' does not exist"))
    out = io.StringIO()
    repl = Repl(failed, DEFAULTS, out=out)
    assert repl.execute(":stats") and repl.execute(":vars")
    assert "error: model path '/nope.gguf' does not exist" in out.getvalue()
    out = io.StringIO()
    repl = Repl(Interrupting(), DEFAULTS, out=out)
    assert repl.execute(":stats") and repl.execute(":stats")
    assert "[interrupted]" in out.getvalue() and "cache hit rate" in out.getvalue()


def test_an_unwritable_history_file_falls_back_to_memory(tmp_path):
    from stemma.lang.repl import _writable
    assert _writable(str(tmp_path / "history"))
    assert not _writable(str(tmp_path / "no" / "such" / "dir" / "history"))


@pytest.mark.parametrize("how", ["file", "pipe"])
def test_inputs_from_a_file_or_a_pipe_run_each_echoed_after_its_prompt(tmp_path, how):
    """A stdin that is no terminal is read line by line (prompt_toolkit read EOF at once from a
    file: nothing ran, and the exit status was 0)."""
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("The capital of France is\nmulti \\\nline\n:vars\n")
    argv = [sys.executable, "-m", "stemma", "repl", "--backend", "mock", "--history", ""]
    with open(inputs) as f:
        out = subprocess.run(argv, stdin=f if how == "file" else None,
                             input=None if how == "file" else inputs.read_text(),
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    first = lines.index("stemma> The capital of France is")
    assert lines[first + 1].strip()  # its continuation
    assert "stemma> multi \\" in lines and "....... line" in lines
    assert any(line.startswith("_ = ") for line in lines)  # :vars ran
