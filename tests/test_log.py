"""stemma.log: the `stemma` logger's one stderr handler, and `--log-level` reaching the server's
child processes (a real `stemma serve` on the tiny llama)."""
import logging
import signal
import subprocess
import sys
import time

import pytest

import stemma
from stemma import log
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer
from tests.served import ENGINE, free_ports


@pytest.fixture
def stemma_logger():
    """The `stemma` logger, put back as it was afterwards."""
    root = logging.getLogger("stemma")
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_importing_stemma_configures_no_logging():
    code = ("import logging, stemma, stemma.serve.gateway, stemma.serve.runtime, stemma.cli; "
            "root = logging.getLogger('stemma'); "
            "assert not root.handlers and root.level == logging.NOTSET and not logging.getLogger().handlers")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_configure_is_idempotent_and_formats_by_level(stemma_logger, capsys):
    log.configure("info")
    log.configure("info")
    assert sum(isinstance(h, log._Stderr) for h in stemma_logger.handlers) == 1
    child = logging.getLogger("stemma.serve.launch")
    child.info("serving %s at %s", "m", "tcp://127.0.0.1:1")
    child.warning("serving on %s without an API key", "0.0.0.0")
    child.debug("not shown")
    err = capsys.readouterr().err
    assert err == ("stemma: serving m at tcp://127.0.0.1:1\n"
                   "stemma: warning: serving on 0.0.0.0 without an API key\n")
    log.configure("DEBUG", prefix="stemma gateway")
    assert sum(isinstance(h, log._Stderr) for h in stemma_logger.handlers) == 1
    child.debug("shown %d", 3)
    assert " stemma.serve.launch debug: shown 3\n" in capsys.readouterr().err
    log.configure("error", prefix="stemma engine")
    child.warning("not shown")
    child.error("broken")
    assert capsys.readouterr().err == "stemma engine: error: broken\n"
    with pytest.raises(ValueError, match="log level"):
        log.configure("verbose")


def test_serve_at_debug_logs_each_request(tmp_path):
    folder = str(save_tiny_tokenizer(build_tiny("llama", tmp_path / "model")))
    zmq_port, http_port = free_ports(2)
    address = f"tcp://127.0.0.1:{zmq_port}"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    stderr = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "stemma", "serve", "--model", folder, "--zmq-port",
                             address.rsplit(":", 1)[1], "--port", str(http_port), "--log-level",
                             "debug", *flags], stderr=stderr)
    try:
        with stemma.connect(address) as client:
            deadline = time.monotonic() + 120
            while not client.health(timeout=0.5):
                assert proc.poll() is None and time.monotonic() < deadline
            # the launcher's own health probe may answer after ours: its "serving" line comes then
            while "info: serving" not in (tmp_path / "stderr").read_text():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            out = client.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                                  timeout=60)
            assert len(out.token_ids) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    stderr.seek(0)
    text = stderr.read()
    assert "stemma: serving" not in text  # at debug every line names its logger
    for line in ("stemma.serve.launch info: serving", "stemma.serve.gateway debug: request",
                 "3 prompt tokens", "routed to engine id", "finished (sequence 1 of 1): length, 3 tokens",
                 "stemma.engine.process debug: request", "taken in: 1 sequences"):
        assert line in text, text
