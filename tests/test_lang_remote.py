"""Programs on a stemma server (stemma.Runtime on a tiny model) through the remote backend: the
same outputs as on the in-process engine, and a clear error for an unreachable server."""
import contextvars
import socket
import time

import pytest

import stemma
from stemma.lang.backends.engine import EngineBackend
from stemma.lang.backends.remote import RemoteBackend
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

ENGINE = dict(dtype="float32", attention_backend="torch", kv_pool_tokens=8192, max_running_requests=32)
W = words()


@stemma.function
def program(s, topic):
    s += " ".join(W[:40]) + " " + topic
    s += stemma.gen("first", max_new_tokens=8, stop=W[9])
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += " " + W[i + 20] + stemma.gen("idea", max_new_tokens=5)
    forks.join()
    s += " " + W[4] + stemma.select("pick", [W[1], W[2] + " " + W[3]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("lang_remote"))))


def test_remote_backend_matches_the_engine(folder):
    local = program.run(topic=W[60], backend=EngineBackend(stemma.Engine(folder, **ENGINE)),
                        sampling={"temperature": 0})
    with stemma.Runtime(model_path=folder, **ENGINE) as rt:  # SGLang's name for the model
        def with_default():  # set_default_backend(stemma.connect(addr)) in a context of its own
            stemma.set_default_backend(stemma.connect(rt.address))
            return program.run(topic=W[60], sampling={"temperature": 0})

        remote = contextvars.copy_context().run(with_default)
        streamed = program.run(topic=W[60], backend=rt.client, sampling={"temperature": 0}, stream=True)
        deltas = list(streamed.text_iter())
        deadline = time.monotonic() + 10  # each run's EndProgram came on its own loop's socket
        while (stats := rt.client.info()["stats"])["programs_ended"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert remote.vars() == local.vars() and remote.text() == local.text()
    assert "".join(deltas) == streamed.text() == local.text()
    assert [c.cached_tokens for c in remote.calls()] == [c.cached_tokens for c in local.calls()]
    assert remote.usage().cached_tokens >= 3 * 40  # the branches shared the committed prefix
    assert stats["cached_tokens"] >= 2 * remote.usage().cached_tokens and stats["running"] == 0
    # each run through the server was one program: its calls carried its context, and it ended with the run
    assert stats["programs_ended"] == 2 and stats["programs_live"] == 0
    rt.shutdown()  # SGLang's name for close(): once closed, nothing more to do
    assert not rt.running
    # 8 requests each: first, the fork's prefill, 3 ideas, the select's prefill and its 2 choices
    assert [p["calls"] for p in stats["programs"]] == [8, 8]


def test_unreachable_server_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = RemoteBackend(f"tcp://127.0.0.1:{port}", connect_timeout=1.0)
    with pytest.raises(stemma.BackendUnreachable,
                       match=rf"server at tcp://127.0.0.1:{port} is unreachable: no answer within 1 s"):
        program.run(topic="x", backend=backend)
    backend.close()


def test_programs_starting_on_many_threads_load_the_codec_once(monkeypatch):
    """f.run() from a thread pool over a fresh endpoint: each first run asked the server's info
    on one shared socket and loaded the tokenizer at once (6 of 60 programs failed)."""
    from concurrent.futures import ThreadPoolExecutor
    asked = []

    class SlowClient:
        address = "tcp://127.0.0.1:1"

        def info(self, timeout=None):
            asked.append(timeout)
            time.sleep(0.2)
            return {"model": "m"}
    monkeypatch.setattr(RemoteBackend, "_codec_from", lambda self, info: object())
    backend = RemoteBackend(SlowClient())
    with ThreadPoolExecutor(8) as pool:
        codecs = list(pool.map(lambda _: backend.codec, range(8)))
    assert len(asked) == 1 and all(codec is codecs[0] for codec in codecs)
