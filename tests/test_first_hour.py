"""The first hour of a new user (issue 16), without a model: the CLI explains itself (help text,
list flags, escapes, "did you mean"), addresses are checked where given, the mock backend honours
constraints, messages say what is true, `dir(stemma)` is clean, and the README says what a
program writer needs."""
import asyncio
import io
import json
import logging
import re
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import zmq

import stemma
from stemma.cli import build_parser
from stemma.cli_args import collect
from stemma.engine_config import EngineConfig
from stemma.field_doc import help_of
from stemma.lang.backends.mock import MockBackend
from stemma.lang.escapes import unescape
from stemma.lang.repl import Repl
from stemma.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "stemma", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ---- 4. help text ----
@pytest.mark.parametrize("cls", [SamplingParams, EngineConfig])
def test_every_field_has_help_text(cls):
    missing = [f.name for f in fields(cls) if not (help_of(f) or "").strip()]
    assert not missing, f"{cls.__name__} fields without help text: {missing}"


def test_generate_help_describes_every_option_with_its_choices():
    proc = cli("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    described = text.split("options:", 1)[1]  # past the usage lines: one entry per option
    for cls in (SamplingParams, EngineConfig):
        for f in fields(cls):
            at = described.index("--" + f.name.replace("_", "-") + " ")
            words = " ".join(help_of(f).split()[:4])
            assert words in described[at:at + 160], (f.name, described[at:at + 160])
    for flag, choices in [("--schedule-policy", "{fcfs,lpm,dfs-weight,sjf,program}"),
                              ("--radix-eviction", "{lru,program}"),
                          ("--batching", "{continuous,dynamic,static}"),
                          ("--dtype", "{auto,float32,bfloat16,float16,fp32,bf16,fp16}"),
                          ("--attention-backend", "{auto,torch,triton}"),
                          ("--quantization", "{auto,none,int8,int4}"),
                          ("--int4-group-size", "{32,64,128}")]:
        assert f"{flag} {choices}" in text
    assert "(default: None)" not in text
    assert "--model MODEL a GGUF file or a Hugging Face model folder; not given: the default model" in text
    assert "--temperature TEMPERATURE 0 (or anything below 1e-05) means greedy (default: 0.0)" in text  # the command's default


def test_a_wrong_flag_gets_a_suggestion_and_its_value_never_becomes_the_prompt():
    proc = cli("generate", "--temprature", "0", "Hi")
    assert proc.returncode == 2
    assert "unknown option --temprature (did you mean --temperature?)" in proc.stderr
    proc = cli("run", "x.stm", "--max-new-tokns", "3")
    assert "unknown option --max-new-tokns (did you mean --max-new-tokens?)" in proc.stderr
    proc = cli("generate", "--frobnicate", "10", "Hi")
    assert proc.returncode == 2 and "unknown option --frobnicate; see stemma generate --help" in proc.stderr
    assert "Hi" not in proc.stdout
    proc = cli("--version")  # it said "the following arguments are required: command"
    assert proc.returncode == 0 and proc.stdout.strip() == f"stemma {stemma.__version__}"


def test_max_tokens_is_an_alias_of_max_new_tokens():
    ns = build_parser().parse_args(["generate", "--max-tokens", "10", "Hi"])
    assert ns.prompt == "Hi" and collect(ns, SamplingParams) == {"max_new_tokens": 10}
    ns = build_parser().parse_args(["run", "p.stm", "--min-tokens", "2"])
    assert collect(ns, SamplingParams)["min_new_tokens"] == 2


# ---- 2. list flags ----
def test_list_flags_take_several_values_and_repeat():
    ns = build_parser().parse_args(["generate", "Hi", "--stop-token-ids", "1", "2", "--stop", ".",
                                    "--stop", "XYZ", "--stop-token-ids", "3,4",
                                    "--logit-bias", "5=-1.5", "6=2"])
    params = SamplingParams.from_dict(collect(ns, SamplingParams))
    assert params.stop == (".", "XYZ")
    assert params.stop_token_ids == (1, 2, 3, 4)
    assert params.logit_bias == ((5, -1.5), (6, 2.0))
    assert collect(build_parser().parse_args(["generate", "Hi", "--stop-token-ids", "7"]),
                   SamplingParams) == {"stop_token_ids": [7]}
    proc = cli("generate", "Hi", "--stop-token-ids", "x")
    assert proc.returncode == 2 and "expected token ids (7 or 7,8), got 'x'" in proc.stderr


def test_flags_before_the_prompt_leave_it_alone():
    """The usage line's order, `stemma generate [options] PROMPT`: a true/false flag took the
    prompt as its value ("expected true or false, got 'The capital...'"), a list flag took it as
    one more item."""
    ns = build_parser().parse_args(["generate", "--logprobs", "--ignore-eos", "false", "--stop-token-ids",
                                    "1", "2", "--logit-bias", "5=-1", "The capital of France is"])
    assert ns.prompt == "The capital of France is"
    assert collect(ns, SamplingParams) == {"logprobs": True, "ignore_eos": False, "stop_token_ids": [1, 2],
                                           "logit_bias": [(5, -1.0)]}
    ns = build_parser().parse_args(["run", "--enable-radix-cache", "examples/qa.stm"])
    assert ns.program == "examples/qa.stm" and ns.enable_radix_cache is True
    ns = build_parser().parse_args(["generate", "--stop-token-ids", "7", "--", "42"])  # a numeric prompt
    assert ns.prompt == "42" and ns.stop_token_ids == [7]


# ---- 3. escapes ----
@pytest.mark.parametrize("typed, read", [
    (r"a\nb", "a\nb"), (r"tab\there", "tab\there"), (r"\\n", "\\n"), (r"\d+", "\\d+"),
    (r"\x41\u00e9\N{BULLET}", "Aé•"), ("end\\", "end\\"), (r"say \"hi\"", 'say "hi"')])
def test_the_escape_rule(typed, read):
    assert unescape(typed) == read


def test_one_escape_rule_in_the_cli_the_repl_and_stm():
    ns = build_parser().parse_args(["generate", "--stop", r"\n", "--regex", r"\d+\n", r"Q:\nA:"])
    assert collect(ns, SamplingParams) == {"stop": ["\n"], "regex": r"\d+\n"}  # patterns as typed
    stm = stemma.compile_text(r'Q:\n{gen a stop="\n" regex="\d+"}')
    assert stm.nodes[0].value == "Q:\n" and dict(stm.nodes[1].params)["stop"] == ("\n",)
    assert dict(stm.nodes[1].params)["regex"] == r"\d+"
    out = io.StringIO()
    repl = Repl(MockBackend(), {"max_new_tokens": 4, "temperature": 0}, out=out)
    repl.execute(r"one\ntwo{gen x}")
    repl.execute(r":set topic=a\tb")
    assert out.getvalue().startswith("one\ntwo") and repl.vars["topic"] == "a\tb"


# ---- 5. addresses ----
@pytest.mark.parametrize("address, words", [
    ("127.0.0.1:30000", "give tcp://127.0.0.1:30000 for the server's ZeroMQ port or http://127.0.0.1:30000"),
    ("localhost", "names no protocol"), ("http://", "names no host"), ("tcp://127.0.0.1", "needs a port"),
    ("tcp://host:99999", "not a number in [1, 65535]"), ("zmq://host:1", "zmq:// is not a protocol"),
    ("ipc://", "needs a path"),
    ("tcp://127.0.0.1:30001/", "tcp:// takes host:port only: tcp://127.0.0.1:30001"),  # ZMQError, late
    ("http://127.0.0.1:30000/v1", "stemma.connect takes the server itself: http://127.0.0.1:30000")])
def test_bad_addresses_are_value_errors_naming_the_accepted_forms(address, words, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("an address check touched the network")
    monkeypatch.setattr(zmq.Socket, "connect", no_network)
    monkeypatch.setattr("socket.create_connection", no_network)
    for attempt in (lambda: stemma.connect(address), lambda: stemma.set_default_backend(address),
                    lambda: stemma.compile_text("x").run(backend=address),
                    lambda: stemma.RuntimeEndpoint(address)):
        with pytest.raises(ValueError) as info:
            attempt()
        assert words in str(info.value)
        assert "tcp://host:port" in str(info.value) and "http://host:port" in str(info.value)


def test_good_addresses_make_clients_without_connecting():
    assert type(stemma.connect("tcp://127.0.0.1:30001")).__name__ == "Client"
    assert type(stemma.connect("http://127.0.0.1:30000")).__name__ == "HttpClient"
    assert type(stemma.connect("https://example.com/stemma")).__name__ == "HttpClient"


def test_a_port_that_speaks_the_other_protocol_is_named(tmp_path):
    import socket
    import threading
    ctx = zmq.Context()  # its own: a socket that took HTTP bytes must not share the process's context
    router = ctx.socket(zmq.ROUTER)
    zport = router.bind_to_random_port("tcp://127.0.0.1")
    listener = socket.create_server(("127.0.0.1", 0))
    hport = listener.getsockname()[1]

    def http_server():  # answers anything as an HTTP server would, then closes
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=http_server, daemon=True).start()
    try:
        program = stemma.compile_text("hi {gen x}")
        start = time.monotonic()
        with pytest.raises(stemma.BackendUnreachable, match=rf"http://127.0.0.1:{zport} speaks ZeroMQ, "
                                                            rf"not HTTP: connect to tcp://127.0.0.1:{zport}"):
            program.run(backend=f"http://127.0.0.1:{zport}")
        with pytest.raises(stemma.BackendUnreachable, match=rf"tcp://127.0.0.1:{hport} answered, but not in "
                                                            rf"ZeroMQ: is it an HTTP port\?"):
            program.run(backend=f"tcp://127.0.0.1:{hport}")
        assert time.monotonic() - start < 10  # said at once, not after a timeout
        with pytest.raises(stemma.ServerError, match="speaks ZeroMQ, not HTTP"):
            stemma.connect(f"http://127.0.0.1:{zport}").info(timeout=1)
        start = time.monotonic()  # with no timeout (the default) a call waited there for ever
        client = stemma.connect(f"http://127.0.0.1:{zport}")
        with pytest.raises(stemma.ServerError, match="speaks ZeroMQ, not HTTP"):
            client.generate("hi", {"max_new_tokens": 2})
        with pytest.raises(stemma.ServerError, match="speaks ZeroMQ, not HTTP"):
            asyncio.run(client.agenerate("hi", {"max_new_tokens": 2}))
        with pytest.raises(stemma.ServerError, match="speaks ZeroMQ, not HTTP"):
            next(iter(client.stream("hi", {"max_new_tokens": 2})))
        assert time.monotonic() - start < 10
    finally:
        listener.close()
        router.close(linger=0)
        ctx.destroy(linger=0)


# ---- 6. the mock honours constraints ----
@stemma.function
def constrained(s):
    s += "Count: " + stemma.gen("digits", regex=r"[0-9]+", max_tokens=8)
    s += " int: " + stemma.gen("i", dtype=int, max_tokens=8)
    s += " float: " + stemma.gen("f", dtype="float", max_tokens=12)
    s += " bool: " + stemma.gen("b", dtype=bool, max_tokens=8)
    s += " str: " + stemma.gen("st", dtype=str, max_tokens=20)
    s += " color: " + stemma.gen("color", choices=["red", "green", "blue"])
    s += " word: " + stemma.gen("w", regex=r"(hello|world) [a-z]{3,5}!", max_tokens=30)
    s += " json: " + stemma.gen("j", json_schema={"type": "object", "properties": {
        "n": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}}, "required": ["n", "name"]},
        max_tokens=80)


def test_mock_output_fullmatches_regex_and_dtype_and_picks_a_choice():
    from stemma.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
    state = constrained.run(backend=MockBackend())
    patterns = {"digits": r"[0-9]+", "i": REGEX_INT, "f": REGEX_FLOAT, "b": REGEX_BOOL,
                "st": REGEX_STR, "w": r"(hello|world) [a-z]{3,5}!"}
    for name, pattern in patterns.items():
        assert re.fullmatch(pattern, state[name]), (name, state[name])
    int(state["i"]), float(state["f"])
    assert state["color"] in ("red", "green", "blue")
    data = json.loads(state["j"])
    assert set(data) == {"n", "name"} and isinstance(data["n"], int) and len(data["name"]) <= 8
    assert re.fullmatch(r'\{"n":-?\d+,"name":"[^"]*"\}', state["j"])  # compact, as the engine's
    assert constrained.run(backend=MockBackend()).vars() == state.vars()  # deterministic


def test_mock_constraints_within_the_budget():
    state = stemma.compile_text('{gen a regex="[a-z]{3}" max_tokens=2}{gen b regex="x+" max_tokens=1}'
                                ).run(backend=MockBackend())
    assert re.fullmatch(r"[a-z]{2}", state["a"])  # no match fits: the start of a shortest one
    assert state.meta("a").finish_reason == "length"
    assert state["b"] == "x" and state.meta("b").finish_reason == "stop"
    with pytest.raises(ValueError, match="not grammars"):
        stemma.compile_text('{gen g grammar="start: \\"a\\""}').run(backend=MockBackend())
    @stemma.function
    def unique(s):
        s += stemma.gen("u", json_schema={"type": "array", "uniqueItems": True})

    with pytest.raises(ValueError, match="^json_schema keyword 'uniqueItems'"):  # as the engine
        unique.run(backend=MockBackend())
    # where the pattern may end it may also go on (outlines-core's own Index never wrote "abc")
    outs = {stemma.compile_text(f'{i}: {{gen a regex="a|abc" max_tokens=3}}').run(backend=MockBackend())["a"]
            for i in range(16)}  # the mock's choices are seeded by the prompt
    assert outs == {"a", "abc"}


# ---- 7. messages ----
def test_the_repl_names_its_variables_when_one_is_unknown():
    out = io.StringIO()
    repl = Repl(MockBackend(), {"max_new_tokens": 4, "temperature": 0}, out=out)
    repl.execute(":set mood=calm")
    repl.execute("Hello{gen greeting}")
    repl.execute("{topic}")
    assert "unknown variable {topic}" in out.getvalue()
    assert "(known: greeting, mood); `:set name=value` sets one" in out.getvalue()


def test_variable_not_generated_names_the_gens_still_running():
    @stemma.function
    def reads_too_soon(s):
        s += "hi" + stemma.gen("a", max_new_tokens=4)
        s["b"]

    with pytest.raises(stemma.VariableNotGenerated, match=r"'b' was never generated.*\(variables so "
                                                         r"far: (none; still being generated: a|a)\)"):
        reads_too_soon.run(backend=MockBackend())


def test_an_unclosed_brace_is_reported_where_it_opens():
    with pytest.raises(stemma.StmSyntaxError) as info:
        stemma.compile_text("line one\nQ: {gen answer\nmore text\nand more")
    assert (info.value.where.line, info.value.where.column) == (2, 4)
    assert "this '{' is never closed" in str(info.value)
    with pytest.raises(stemma.StmSyntaxError, match=r"the hole opened at <text>:1:3 is never closed"):
        stemma.compile_text("a {gen x\nb {y}")


def test_peer_watch_takes_frames_of_an_http_client_at_the_zeromq_port():
    """An HTTP request's bytes parse as ZeroMQ 1.0 frames, whose source descriptor ZeroMQ does
    not keep (EINVAL): seen() skips them instead of raising (the gateway's old traceback)."""
    import socket
    from stemma.serve.peer_watch import PeerWatch, configure, source_fd
    ctx = zmq.Context()  # its own: a socket that took HTTP bytes must not share the process's context
    router = ctx.socket(zmq.ROUTER)
    configure(router)
    watch = PeerWatch(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request * 3)
        assert router.poll(5000)
        frames = router.recv_multipart(copy=False)
        assert source_fd(frames[-1]) == -1
        watch.seen(frames[0].bytes, frames[-1])  # raised zmq.error.ZMQError: Invalid argument
        assert watch.fd_of == {}
        assert watch.first_strange(frames[0].bytes) and not watch.first_strange(frames[0].bytes)
    watch.close()
    router.close(linger=0)
    ctx.destroy(linger=0)


# ---- 8. dir(stemma) ----
def test_dir_stemma_lists_each_public_name_once():
    stemma.gen, stemma.function, stemma.lang  # bind some names and a submodule first
    names = dir(stemma)
    assert len(names) == len(set(names))
    assert not {"os", "import_module", "lang", "_LAZY"} & set(names)
    assert {"gen", "select", "function", "Engine", "connect", "__version__"} <= set(names)
    star: dict = {}
    exec("from stemma import *", star)  # imported nothing: the names are lazy, and there was no __all__
    assert {"gen", "select", "function", "connect", "set_default_backend"} <= set(star)


# ---- 9. the README ----
def test_the_readme_says_what_a_program_writer_needs():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "The parent sees them only after `forks.join()`: then `s[\"x\"]` is the list of the branches' values in fork order" in text
    assert "a gen's own options override them, field by field, for that gen only" in text
    assert "sample at `SamplingParams`' default temperature, 1.0" in text
    assert "The `stemma` commands (`generate`, `run`, `repl`) default to greedy" in text
    assert "What the default model limits:" in text and "computed `1000 - 8849`" in text
    assert "Escapes, one rule for every text you type" in text
    react = (ROOT / "examples" / "react_agent.py").read_text()
    assert "Everest plus 1000" not in react.split("QUESTIONS = [", 1)[1]


# ---- 1. the first index build is announced ----
def test_the_first_build_of_a_constraint_index_is_logged(caplog):
    from stemma.constrained.index_cache import IndexCache
    from stemma.constrained.vocab import TokenVocab
    vocab = TokenVocab(token_bytes=(None, b"a", b"b", b"1", b"2"), eos_token_id=0, end_ids=(0,),
                       special={0: "</s>"})
    cache = IndexCache(4)
    with caplog.at_level(logging.INFO, logger="stemma.constrained.index_cache"):
        cache.get("[ab]+1", vocab)
        first = [r.getMessage() for r in caplog.records]
        cache.get("[ab]+1", vocab)
    assert any("building the constraint index of a new pattern (6-char regex) over 5 tokens" in m
               for m in first)
    assert any(re.match(r"built the constraint index in \d+\.\d s", m) for m in first)
    assert len(caplog.records) == len(first)  # a cached pattern is quiet
