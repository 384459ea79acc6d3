"""The first hour of a new user (issue 16), where a model or a server process is involved: a cold
start shows progress at once, `stemma generate` separates its outputs and prints logprobs, the
REPL greets before its model is ready, and the gateway takes an HTTP client at its ZeroMQ port
with one warning line."""
import logging
import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from stemma import protocol as P
from tests.test_lang_repl import Terminal
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIRST_LINE_S = 2.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("first_hour"))
    return str(save_tiny_tokenizer(path))


def _line(stream, deadline: float) -> str | None:
    """The next line of `stream` (a pipe) before `deadline`, or None."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([stream], [], [], left)[0]:
        return None
    return stream.readline().decode(errors="replace")


def test_a_cold_start_shows_progress_within_two_seconds(tmp_path):
    """The default model on a fresh cache folder: the first progress line within 2 s of the
    command's start, then the cold stage itself is announced; stopped there (the whole cold
    load takes 40-50 s)."""
    env = {**os.environ, "STEMMA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "stemma", "generate", "Hi", "--max-new-tokens", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        first = _line(proc.stderr, start + FIRST_LINE_S)
        assert first is not None, f"no progress line within {FIRST_LINE_S} s"
        assert re.match(r"stemma: \[\s*\d+\.\ds\] loading the default model", first), first
        seen = [first]
        while not any("first load of" in line for line in seen):
            line = _line(proc.stderr, start + 120)
            assert line, f"no cold-start stage line; saw {seen}"
            seen.append(line)
        assert all(re.match(r"stemma: \[\s*\d+\.\ds\] ", line) for line in seen), seen
        cold = seen[-1]
        assert "cached under" in cold and str(tmp_path / "cache") in cold
    finally:
        proc.kill()
        proc.wait(30)


def test_generate_separates_n_outputs_and_prints_logprobs(folder):
    proc = subprocess.run([sys.executable, "-m", "stemma", "generate", "alpha beta", "--model", folder,
                           "--dtype", "float32", "--n", "2", "--temperature", "1", "--seed", "3",
                           "--max-tokens", "4", "--ignore-eos", "--logprobs", "--top-logprobs", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--- output 1 of 2 (length) ---\nalpha beta" in out and "--- output 2 of 2 (length) ---" in out
    tables = re.findall(r"--- logprobs: token, logprob, top alternatives ---\n((?:  .*\n?){4})", out)
    assert len(tables) == 2, out
    for table in tables:
        for row in table.strip("\n").split("\n"):
            assert re.match(r"\s+'.*' +-?\d+\.\d{4}   top: '.*' -?\d+\.\d{3}, '.*' -?\d+\.\d{3}$", row), row
    assert re.search(r"stemma: \[\s*\d+\.\ds\] building the llama model", proc.stderr)
    stream = subprocess.run([sys.executable, "-m", "stemma", "generate", "x", "--stream", "--n", "2",
                             "--model", folder], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert stream.returncode == 2 and "drop it for --n, --logprobs or --top-logprobs" in stream.stderr


def test_the_repl_greets_before_its_model_is_ready(folder, tmp_path):
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200", "LINES": "50"}
    start = time.monotonic()
    term = Terminal([sys.executable, "-m", "stemma", "repl", "--backend", "engine", "--model", folder,
                     "--dtype", "float32", "--ignore-eos", "--max-tokens", "3",
                     "--history", str(tmp_path / "history")], env)
    try:
        term.expect(r"stemma repl: a plain prompt continues the text", timeout=FIRST_LINE_S + 1)
        assert time.monotonic() - start < FIRST_LINE_S + 1
        term.expect(r"loading the model in the background .* you can type now", timeout=5)
        term.send("alpha beta\r")  # typed while it loads: runs once the model is ready
        term.expect(r"model ready \(\d+\.\d s\)", timeout=120)
        ran = term.expect(r"\n\s*\S+ \S+ \S+\s*\nstemma>$", timeout=60)  # its 3-token continuation
        assert "error" not in ran
        term.send(":quit\r")
        assert term.proc.wait(30) == 0
    finally:
        term.close()


def test_an_http_client_at_the_zeromq_port_is_one_warning_line(folder, tmp_path, caplog, monkeypatch):
    from stemma.serve.gateway import Gateway, GatewaySpec, logger
    monkeypatch.setattr(logger, "disabled", False)  # an in-process uvicorn's dictConfig disables it
    ipc = f"ipc://{tmp_path}/"
    spec = GatewaySpec(address="tcp://127.0.0.1:0", requests=ipc + "req", outputs=ipc + "out")
    ctx = zmq.Context()  # its own: the process's shared context stays as the other tests left it
    gateway = Gateway(spec, ctx)
    try:
        gateway.open(P.EngineReady(model=folder, context_length=128, vocab_size=96))
        port = int(gateway.router.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n"
        with caplog.at_level(logging.DEBUG, logger="stemma.serve.gateway"), \
                socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request * 4)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until 1 s after the first warning
                if gateway.router.poll(100):
                    gateway._drain(gateway.router, gateway.on_client_guarded)
                if any(r.levelno >= logging.WARNING for r in caplog.records):
                    deadline = min(deadline, time.monotonic() + 1.0)
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(records) == 1, [r.getMessage() for r in records]
        assert records[0].exc_info is None  # one line, no traceback
        assert "sent a message that is not stemma's protocol" in records[0].getMessage()
        assert "an HTTP client belongs on the HTTP port" in records[0].getMessage()
    finally:
        gateway.close()
        ctx.destroy(linger=0)
