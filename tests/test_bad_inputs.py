"""Bad inputs on every surface, one table per surface: each row is an input and the error it must
get. docs/reliability.md lists them all (input, surface, error, test); the last test here checks
that every row of that table names a test that exists, so the two cannot drift apart.

Surfaces: SamplingParams (in process), Engine.generate (in process, a tiny ByteLevel llama with a
128-token context), the ZeroMQ protocol and the HTTP API (one `stemma serve` of the same model),
the CLI, and the frontend language.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import msgpack
import pytest

import stemma
from stemma import protocol as P
from stemma.engine.request import RequestFailed
from stemma.lang.stm import compile_text
from stemma.sampling_params import SamplingParams
from tests.bytelevel_tokenizer import build_tiny_bytelevel
from tests.served import ENGINE, HttpServed, raw_dealer

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
KEY = "bad-inputs-key"
FRAME_LIMIT = 64 * 1024
CONTEXT = 128
OK = dict(temperature=0.0, max_new_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_bytelevel(tmp_path_factory.mktemp("bad_inputs")))


@pytest.fixture(scope="module")
def engine(folder):
    return stemma.Engine(folder, **{**ENGINE, "kv_pool_tokens": 2048}, max_context=CONTEXT)


@pytest.fixture(scope="module")
def server(folder):
    served = HttpServed(folder, "--api-key", KEY, "--max-frame-bytes", str(FRAME_LIMIT),
                        "--served-model-name", "tiny", engine={"max_context": CONTEXT})
    yield served
    assert served.stop() == 0


# ---------------------------------------------------------------- SamplingParams, in process

SAMPLING = {  # kind: (fields, the ValueError's message starts with)
    "max_new_tokens_negative": ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
    "max_new_tokens_float": ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
    "min_over_max_new_tokens": ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens must be <="),
    "temperature_negative": ({"temperature": -0.5}, "temperature must be >= 0"),
    "temperature_nan": ({"temperature": math.nan}, "temperature must be finite"),
    "temperature_string": ({"temperature": "hot"}, "temperature must be a number"),
    "top_p_zero": ({"top_p": 0.0}, "top_p must be > 0"),
    "top_p_over_one": ({"top_p": 1.5}, "top_p must be <= 1"),
    "top_k_zero": ({"top_k": 0}, "top_k must be -1 (off) or >= 1"),
    "min_p_over_one": ({"min_p": 1.5}, "min_p must be <= 1"),
    "repetition_penalty_zero": ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    "frequency_penalty_out_of_range": ({"frequency_penalty": 3.0}, "frequency_penalty must be <= 2"),
    "presence_penalty_out_of_range": ({"presence_penalty": -3.0}, "presence_penalty must be >= -2"),
    "stop_empty_string": ({"stop": [""]}, "stop must hold non-empty strings"),
    "stop_not_a_string": ({"stop": 5}, "stop must be a string, a list of strings or None"),
    "stop_token_ids_negative": ({"stop_token_ids": [-1]}, "stop_token_ids must hold ints >= 0"),
    "stop_token_ids_past_int64": ({"stop_token_ids": [2 ** 64 + 102]}, "stop_token_ids must hold ints >= 0 and < 2**63"),
    "logit_bias_key_past_int64": ({"logit_bias": {2 ** 64: 1.0}}, "logit_bias keys must be token ids"),
    "max_new_tokens_past_int64": ({"max_new_tokens": 2 ** 64}, "max_new_tokens must be < 2**63"),
    "logit_bias_key_not_a_token": ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
    "logit_bias_out_of_range": ({"logit_bias": {5: 200.0}}, "logit_bias must be <= 100"),
    "seed_past_int64": ({"seed": 2 ** 63}, "seed must be < 2**63"),
    "n_zero": ({"n": 0}, "n must be >= 1"),
    "top_logprobs_negative": ({"top_logprobs": -1}, "top_logprobs must be >= 0"),
    "logprob_start_negative": ({"logprob_start": -1}, "logprob_start must be >= 0"),
    "ignore_eos_not_bool": ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
    "regex_empty": ({"regex": ""}, "regex must be a non-empty string"),
    "two_constraints": ({"regex": "a+", "grammar": "start: \"a\""}, "grammar cannot be combined with regex"),
    "json_schema_not_json": ({"json_schema": "{nope"}, "json_schema is not valid JSON"),
    "json_schema_not_an_object": ({"json_schema": "[1]"}, "json_schema must be a JSON object"),
    "unknown_field": ({"temprature": 1.0}, "unknown SamplingParams fields: temprature"),
}


@pytest.mark.parametrize("kind", SAMPLING)
def test_sampling_params(kind):
    fields, words = SAMPLING[kind]
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict(fields)
    assert str(info.value).startswith(words), info.value


# ---------------------------------------------------------------- Engine.generate, in process

ENGINE_INPUTS = {  # kind: (prompt, params, a pattern its ValueError's message matches)
    "empty_text": ("", OK, r"^prompt must hold at least one token"),
    "token_outside_vocab": ([5, 10 ** 6], OK, r"^prompt holds token ids outside \[0, \d+\)"),
    "prompt_past_context": ([5] * (CONTEXT + 10), OK, r"context|max_prompt_tokens"),
    "stop_token_ids_outside_vocab": ([5, 6], {**OK, "stop_token_ids": [10 ** 6]},
                                     r"^stop_token_ids holds token ids outside"),
    "logit_bias_outside_vocab": ([5, 6], {**OK, "logit_bias": {10 ** 6: 1.0}},
                                 r"^logit_bias holds token ids outside"),
    "params_not_a_mapping": ([5, 6], 42, r"^params must be SamplingParams or a dict"),
}


@pytest.mark.parametrize("kind", ENGINE_INPUTS)
def test_engine_generate(engine, kind):
    prompt, params, pattern = ENGINE_INPUTS[kind]
    with pytest.raises(ValueError, match=pattern):
        engine.generate(prompt, params)
    assert len(engine.generate([5, 6], OK).token_ids) == OK["max_new_tokens"]  # still serving
    engine.check_pool_whole()


def test_engine_stream_with_n_above_one(engine):
    with pytest.raises(ValueError, match="n must be 1 when streaming, got 2"):
        list(engine.stream([5, 6], {**OK, "n": 2}))


def test_engine_params_list_of_the_wrong_length(engine):
    with pytest.raises(ValueError, match="params has 2 entries for 1 prompts"):
        engine.generate([[5, 6]], [OK, OK])


def nested(depth: int) -> dict:
    """{"not": {"not": ... {"type": "string"}}}: a valid schema `depth` levels deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"not": schema}
    return schema


CONSTRAINTS = {  # kind: (params, pattern); the request fails, the engine goes on
    "regex_that_does_not_compile": ({"regex": "(unclosed"}, r"^regex: .* cannot be compiled"),
    "grammar_that_does_not_parse": ({"grammar": "start: ("}, r"grammar"),
    "json_schema_that_is_not_a_schema": ({"json_schema": {"type": "nonsense"}}, r"^json_schema is invalid"),
    # jsonschema's own check raised TypeError, and recursed past the limit: in the engine process
    # either ended the process (every request failed, and each such message cost a restart)
    "json_schema_whose_check_raised_type_error": ({"json_schema": {"$schema": []}},
                                                  r"^json_schema is not supported: TypeError"),
    "json_schema_nested_past_the_recursion_limit": ({"json_schema": nested(200)},
                                                    r"^json_schema is nested too deeply"),
}


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_engine_bad_constraint(engine, kind):
    params, pattern = CONSTRAINTS[kind]
    with pytest.raises((ValueError, RequestFailed), match=pattern):
        engine.generate([5, 6], {**OK, **params})
    assert len(engine.generate([5, 6], OK).token_ids) == OK["max_new_tokens"]
    engine.check_pool_whole()


# ---------------------------------------------------------------- the ZeroMQ protocol

def wire(**fields) -> bytes:
    return msgpack.packb({"version": P.PROTOCOL_VERSION, **fields})


def generate(**fields) -> bytes:
    return wire(type="generate", **{"rid": "g", "input_ids": [5, 6], "params": OK, **fields})


ZMQ = {  # kind: (frames after the peer's, code, reply rid, words in the message)
    "zmq_unknown_field": ([KEY, generate(colour="red")], P.BAD_REQUEST, "g", "unknown fields colour"),
    "zmq_missing_field": ([KEY, wire(type="abort")], P.BAD_REQUEST, "", "missing fields rid"),
    "zmq_wrong_version": ([KEY, generate(version=99)], P.BAD_REQUEST, "g", "protocol version 99"),
    "zmq_rid_too_long": ([KEY, generate(rid="r" * 300)], P.BAD_REQUEST, "r" * 300,
                         "rid must hold 1 to 256 characters"),
    "zmq_prompt_and_input_ids": ([KEY, generate(prompt="hi")], P.BAD_REQUEST, "g",
                                 "exactly one of prompt and input_ids"),
    "zmq_neither_prompt_nor_input_ids": ([KEY, wire(type="generate", rid="g")], P.BAD_REQUEST, "g",
                                         "exactly one of prompt and input_ids"),
    "zmq_empty_input_ids": ([KEY, generate(input_ids=[])], P.BAD_REQUEST, "g",
                            "input_ids must hold at least one token"),
    "zmq_not_a_map": ([KEY, msgpack.packb([1, 2, 3])], P.BAD_REQUEST, "", "a message must be a map"),
    "zmq_unknown_sampling_field": ([KEY, generate(params={"temprature": 0})], P.BAD_REQUEST, "g",
                                   "unknown SamplingParams fields: temprature"),
    "zmq_bad_sampling_value": ([KEY, generate(params={"top_p": 0})], P.BAD_REQUEST, "g",
                               "top_p must be > 0"),
    "zmq_cache_tree_limit": ([KEY, wire(type="get_cache_tree", rid="t", limit=0)], P.BAD_REQUEST, "t",
                             "limit must be in [1, 1000]"),
    "zmq_nested_too_deep": ([KEY, b"\x91" * 60_000 + b"\x05"], P.BAD_REQUEST, "", "not a valid msgpack frame"),
    "zmq_map_with_int_keys": ([KEY, msgpack.packb({1: 2})], P.BAD_REQUEST, "", "not a valid msgpack frame"),
    "zmq_one_frame": ([generate()], P.BAD_REQUEST, "", "two frames: [api key, body]"),
    "zmq_three_frames": ([KEY, generate(), b"more"], P.BAD_REQUEST, "", "two frames: [api key, body]"),
    "zmq_empty_key": (["", generate()], P.UNAUTHORIZED, "", "missing or wrong API key"),
    "zmq_stop_token_outside_vocab": ([KEY, generate(params={**OK, "stop_token_ids": [10 ** 6]})],
                                     P.BAD_REQUEST, "g", "stop_token_ids holds token ids outside"),
    # past --max-frame-bytes: its error goes to its own request (to no id, the client failed
    # every request in flight on its socket)
    "zmq_frame_too_large": ([KEY, generate(input_ids=[5] * 70_000)], P.TOO_LARGE, "g", "over the limit"),
    "zmq_json_schema_whose_check_raised": ([KEY, generate(params={**OK, "json_schema": {"$schema": []}})],
                                           P.BAD_REQUEST, "g", "json_schema is not supported"),
    "zmq_json_schema_nested_too_deeply": ([KEY, generate(params={**OK, "json_schema": nested(200)})],
                                          P.BAD_REQUEST, "g", "json_schema is nested too deeply"),
}


@pytest.fixture
def raw(server):
    with raw_dealer(server.address) as sock:
        yield sock


def exchange(sock, frames: list) -> P.Message:
    sock.send_multipart([f.encode() if isinstance(f, str) else f for f in frames])
    assert sock.poll(30_000), "no reply"
    return P.decode(sock.recv_multipart()[-1])


def assert_still_serving(sock) -> None:
    ok = exchange(sock, [KEY, P.encode(P.GenerateReq(rid="ok", input_ids=[5, 6], params=SamplingParams(**OK)))])
    assert isinstance(ok, P.Finished) and len(ok.token_ids) == OK["max_new_tokens"], ok


@pytest.mark.parametrize("kind", ZMQ)
def test_zmq(raw, kind):
    frames, code, rid, words = ZMQ[kind]
    reply = exchange(raw, frames)
    assert isinstance(reply, P.ErrorMsg) and reply.code == code and reply.rid == rid, reply
    assert words in reply.message, reply.message
    assert_still_serving(raw)


def test_zmq_duplicate_rid_while_pending(raw):
    long = P.encode(P.GenerateReq(rid="dup", input_ids=[5, 6], stream=True, params=SamplingParams(
        temperature=0.0, max_new_tokens=100, ignore_eos=True)))
    raw.send_multipart([KEY.encode(), long])
    raw.send_multipart([KEY.encode(), long])
    replies = []
    while not any(isinstance(m, P.Finished) for m in replies):
        assert raw.poll(30_000), "no reply"
        replies.append(P.decode(raw.recv_multipart()[-1]))
    errors = [m for m in replies if isinstance(m, P.ErrorMsg)]
    assert len(errors) == 1 and errors[0].rid == "dup" and errors[0].code == P.BAD_REQUEST, errors
    assert "dup" in errors[0].message
    assert_still_serving(raw)


# ---------------------------------------------------------------- the HTTP API

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BEARER = {"Authorization": f"Bearer {KEY}"}
HTTP = {  # kind: (method, path, request keywords, status, the error's param or None)
    "http_no_key": ("POST", "/v1/completions", {"json": COMPLETION, "headers": {}}, 401, None),
    "http_wrong_key": ("POST", "/v1/completions",
                       {"json": COMPLETION, "headers": {"Authorization": "Bearer nope"}}, 401, None),
    "http_unknown_model": ("POST", "/v1/completions", {"json": {**COMPLETION, "model": "gpt-9"}}, 404, "model"),
    "http_unknown_route": ("GET", "/v2/nothing", {}, 404, None),
    "http_temperature_negative": ("POST", "/v1/completions", {"json": {**COMPLETION, "temperature": -1}},
                                  400, "temperature"),
    "http_max_tokens_not_int": ("POST", "/v1/completions", {"json": {**COMPLETION, "max_tokens": "many"}},
                                400, "max_tokens"),
    "http_top_k_zero": ("POST", "/v1/completions", {"json": {**COMPLETION, "top_k": 0}}, 400, "top_k"),
    "http_n_zero": ("POST", "/v1/completions", {"json": {**COMPLETION, "n": 0}}, 400, "n"),
    "http_logit_bias_key": ("POST", "/v1/completions", {"json": {**COMPLETION, "logit_bias": {"x": 1}}},
                            400, "logit_bias"),
    "http_stop_empty": ("POST", "/v1/completions", {"json": {**COMPLETION, "stop": [""]}}, 400, "stop"),
    "http_stop_token_ids_past_int64": ("POST", "/v1/chat/completions",
                                       {"json": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "stop_token_ids": [2 ** 64 + 102]}}, 400, "stop_token_ids"),
    "http_missing_prompt": ("POST", "/v1/completions", {"json": {"model": "tiny"}}, 400, "prompt"),
    "http_empty_prompt_list": ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": []}}, 400, "prompt"),
    "http_token_outside_vocab": ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": [5, 10 ** 6]}},
                                 400, None),
    "http_prompt_past_context": ("POST", "/v1/completions", {"json": {**COMPLETION, "prompt": "hi " * 400}},
                                 400, None),
    "http_malformed_json": ("POST", "/v1/completions",
                            {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, None),
    "http_body_too_large": ("POST", "/v1/completions",
                            {"json": {**COMPLETION, "prompt": "x" * (2 * FRAME_LIMIT)}}, 413, None),
    "http_bad_regex": ("POST", "/v1/completions", {"json": {**COMPLETION, "regex": "(unclosed"}}, 400, None),
    "http_chat_missing_messages": ("POST", "/v1/chat/completions", {"json": {"model": "tiny"}}, 400, "messages"),
    "http_chat_unknown_role": ("POST", "/v1/chat/completions",
                               {"json": {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}},
                               400, "messages.0.role"),
    "http_chat_schema_missing": ("POST", "/v1/chat/completions", {"json": {
        **CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}},
        400, "response_format.json_schema"),
    "http_native_text_and_ids": ("POST", "/generate", {"json": {"text": "hi", "input_ids": [5]}}, 400, "text"),
    "http_native_neither": ("POST", "/generate", {"json": {"sampling_params": OK}}, 400, "text"),
    "http_native_ids_outside_vocab": ("POST", "/generate", {"json": {"input_ids": [5, 10 ** 6]}}, 400, "input_ids"),
    "http_native_bad_sampling": ("POST", "/generate",
                                 {"json": {"text": "hi", "sampling_params": {"top_p": 0}}}, 400, None),
    "http_tokenize_missing_prompt": ("POST", "/tokenize", {"json": {}}, 400, None),
    "http_detokenize_not_ints": ("POST", "/detokenize", {"json": {"tokens": ["a"]}}, 400, None),
}


def http(server, method: str, path: str, **kw) -> httpx2.Response:
    headers = kw.pop("headers", BEARER)
    return httpx2.request(method, server.url + path, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("kind", HTTP)
def test_http(server, kind):
    method, path, kw, status, param = HTTP[kind]
    response = http(server, method, path, **kw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    assert http(server, "POST", "/v1/completions", json=COMPLETION).status_code == 200  # still serving


# ---------------------------------------------------------------- the CLI

CLI = {  # kind: (arguments, words on stderr); each exits with status 2 before loading a model
    "cli_unknown_flag": (["generate", "--temprature", "0", "Hi"],
                         "unknown option --temprature (did you mean --temperature?)"),
    "cli_bad_choice": (["generate", "--schedule-policy", "random", "Hi"], "invalid choice: 'random'"),
    "cli_not_an_int": (["generate", "--max-new-tokens", "many", "Hi"], "invalid int value: 'many'"),
    "cli_serve_bad_port": (["serve", "--port", "http"], "invalid int value: 'http'"),
}


@pytest.mark.parametrize("kind", CLI)
def test_cli(kind):
    args, words = CLI[kind]
    proc = subprocess.run([sys.executable, "-m", "stemma", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr, proc.stderr


# ---------------------------------------------------------------- the frontend language

STM = {  # kind: (source, words in the StmSyntaxError)
    "stm_unclosed_hole": ("Q: {gen answer", "is never closed"),
    "stm_unclosed_role_block": ("{user}hello", "the {user} block is never closed"),
    "stm_closes_no_block": ("hello{/user}", "closes no open {user} block"),
    "stm_option_twice": ("{gen a max_tokens=3 max_tokens=4}", "option 'max_tokens' is given twice"),
    "stm_select_without_choices": ("{select v}", "needs choices=[...]"),
    "stm_select_unknown_option": ('{select v choices=["a"] colour=1}', "unknown option 'colour'"),
}


@pytest.mark.parametrize("kind", STM)
def test_stm(kind):
    source, words = STM[kind]
    with pytest.raises(stemma.StmSyntaxError) as info:
        compile_text(source)
    assert words in str(info.value), info.value
    assert "<text>:1:" in str(info.value)  # where it is


def test_gen_with_a_bad_sampling_option_fails_where_it_is_written():
    @stemma.function
    def program(s):
        s += stemma.gen("x", temperature=-1.0, max_tokens=2)

    with pytest.raises(ValueError, match="temperature must be >= 0"):
        program.run(backend=stemma.MockBackend())


def test_connect_to_an_address_without_a_scheme():
    with pytest.raises(ValueError) as info:
        stemma.connect("127.0.0.1:30000")
    assert "tcp://127.0.0.1:30000" in str(info.value) and "http://127.0.0.1:30000" in str(info.value)


# ---------------------------------------------------------------- the table in docs/reliability.md

def table_rows() -> list[list[str]]:
    """The rows of the bad-input table: | input | surface | error | test |."""
    lines = DOC.read_text(encoding="utf-8").split("## Bad inputs", 1)[1].splitlines()
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines
            if line.startswith("|")]
    assert rows[0] == ["input", "surface", "error", "test"], rows[0]
    return [r for r in rows[2:] if len(r) == 4]


def collected(files: set[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "", *sorted(files)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def test_every_row_of_the_table_names_a_test_that_exists():
    rows = table_rows()
    ids = [re.fullmatch(r"`([^`]+)`", test).group(1) for *_, test in rows]
    assert len(rows) >= 40 and len(set(ids)) == len(ids)
    inputs = [row[0] for row in rows]
    assert len(set(inputs)) == len(inputs), "two rows name the same input"
    missing = set(ids) - collected({i.split("::")[0] for i in ids})
    assert not missing, f"rows name tests that do not exist: {sorted(missing)}"
