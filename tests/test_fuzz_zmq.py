"""Hypothesis-generated frames against the ZeroMQ port of a real `stemma serve` (a tiny random
llama, in a subprocess), typed and untyped: random bytes, valid msgpack of wrong shapes, maps with
wrong keys, known tags with bad fields, huge maps and arrays, deep nesting, broken envelopes.

The oracle is the protocol's own decoder run here on the same bytes: a frame that does not decode
must get exactly one ErrorMsg (with the request id the decoder could read), an Abort gets nothing,
any other valid request gets its answer. A batch ends with a normal generate, which must succeed;
it is sent last, so every synchronous error of the batch is in before its answer. At least
MIN_FRAMES frames go out per run.
"""
from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stemma import protocol as P
from stemma.sampling_params import SamplingParams
from tests.served import HttpServed, alive, raw_dealer
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

KEY = "fuzz-key"
FRAME_LIMIT = 64 * 1024
BATCH = 60
EXAMPLES = 90
MIN_FRAMES = 5000
REPLY_TIMEOUT_S = 60
OK_TOKENS = 3
HUGE_MAP = 20_000  # entries: past the frame limit, under the 4x hard cap that drops a connection
RID = "\x00rid\x00"  # where a frame's own request id goes (replaced by a unique one when sent)
TERMINAL = (P.Finished, P.ErrorMsg, P.FlushDone, P.Info, P.CacheTree, P.HealthOk)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("fuzz_llama")))
    served = HttpServed(str(folder), "--api-key", KEY, "--max-frame-bytes", str(FRAME_LIMIT),
                        "--max-context", "256")
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def sock(server):
    with raw_dealer(server.address) as sock:
        yield sock


# ---------------------------------------------------------------- strategies

def packable_ints():
    return st.integers(-(2 ** 63), 2 ** 64 - 1)


LEAVES = (st.none() | st.booleans() | packable_ints() | st.floats(allow_nan=True)
          | st.text(max_size=24) | st.binary(max_size=24))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=6), max_leaves=24)
# a valid rid is always the frame's own (unique) one: the wrong ones are no string or no valid string
RIDS = (st.just(RID) | st.just(RID) | packable_ints() | st.text(min_size=257, max_size=300) | st.just("")
        | LEAVES.filter(lambda v: not isinstance(v, str)) | st.lists(LEAVES, max_size=3))

TEMPLATES = {
    "generate": {"input_ids": [5, 6, 7], "params": {"max_new_tokens": 2, "temperature": 0.0}},
    "abort": {},
    "flush_cache": {},
    "get_info": {"check_pool": False},
    "get_cache_tree": {"limit": 5},
    "health": {},
}
FIELDS = {
    "generate": ["prompt", "input_ids", "params", "stream", "salt", "program"],
    "get_info": ["check_pool"],
    "get_cache_tree": ["limit"],
}
PARAM_FIELDS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "n", "stop",
                "logit_bias", "stop_token_ids", "seed", "regex", "json_schema", "top_logprobs",
                "logprob_start", "no_such_field"]
BAD_FIELD_VALUES = (VALUES | st.integers(-10, 10) | st.lists(st.integers(-200, 300), max_size=8)
                    | st.just(-1) | st.just(2 ** 40) | st.just([]) | st.just({}) | st.just(float("inf")))


def message(tag: str, rid) -> dict:
    return {"type": tag, "version": P.PROTOCOL_VERSION, "rid": rid, **TEMPLATES[tag]}


@st.composite
def tagged_with_bad_fields(draw) -> dict:
    """A known message type whose fields are then broken: one replaced, dropped, or added."""
    tag = draw(st.sampled_from(sorted(TEMPLATES)))
    msg = message(tag, draw(RIDS))
    how = draw(st.sampled_from(["replace", "drop", "unknown", "version", "param", "none"]))
    names = FIELDS.get(tag, []) + ["rid"]
    if how == "replace":
        name = draw(st.sampled_from(names))
        msg[name] = draw(RIDS if name == "rid" else BAD_FIELD_VALUES)
    elif how == "drop":
        msg.pop(draw(st.sampled_from(names + ["type", "version"])), None)
    elif how == "unknown":
        msg[draw(st.text(min_size=1, max_size=12))] = draw(VALUES)
    elif how == "version":
        msg["version"] = draw(VALUES | st.integers(-5, 5))
    elif how == "param" and tag == "generate":
        msg["params"] = {**msg["params"], draw(st.sampled_from(PARAM_FIELDS)): draw(BAD_FIELD_VALUES)}
    return msg


def wrong_keys() -> st.SearchStrategy:
    return st.dictionaries(st.text(max_size=12) | st.sampled_from(["type", "rid", "version"]), VALUES,
                           min_size=1, max_size=8).map(lambda d: {**d, "type": d.get("type", "generate")})


def huge_map(size: int) -> dict:
    return {"type": "generate", "version": P.PROTOCOL_VERSION, "rid": RID,
            **{f"k{i}": i for i in range(size)}}


def huge_ids(size: int) -> dict:
    return {**message("generate", RID), "input_ids": [5] * size}


def deep(depth: int, as_field: bool) -> Callable[[str], bytes]:
    """An array nested `depth` deep, alone or as a generate's input_ids (built as bytes: msgpack's
    packer refuses such depths)."""
    nested = b"\x91" * depth + b"\x05"

    def build(rid: str) -> bytes:
        if not as_field:
            return nested
        head = {"type": "generate", "version": P.PROTOCOL_VERSION, "rid": rid}
        return (bytes([0x80 | (len(head) + 1)]) + b"".join(msgpack.packb(k) + msgpack.packb(v)
                                                            for k, v in head.items())
                + msgpack.packb("input_ids") + nested)
    return build


def packed(value) -> Callable[[str], bytes]:
    def build(rid: str) -> bytes:
        if isinstance(value, dict) and value.get("rid") == RID:
            return msgpack.packb({**value, "rid": rid}, use_bin_type=True)
        return msgpack.packb(value, use_bin_type=True)
    return build


def noise(size: int, seed: int) -> Callable[[str], bytes]:
    """`size` random bytes, past the frame limit (drawn from a seeded RNG: hypothesis builds big
    binaries byte by byte, far too slowly)."""
    return raw(random.Random(seed).randbytes(size))


def raw(data: bytes) -> Callable[[str], bytes]:
    return lambda rid: data


BODIES = st.one_of(
    st.binary(max_size=300).map(raw),
    VALUES.map(packed),                                   # any msgpack value: mostly wrong shapes
    st.lists(VALUES, max_size=5).map(packed),
    packable_ints().map(packed),
    wrong_keys().map(packed),
    tagged_with_bad_fields().map(packed),
    tagged_with_bad_fields().map(packed),
    tagged_with_bad_fields().map(packed),
    st.integers(1000, HUGE_MAP).map(lambda n: packed(huge_map(n))),
    st.integers(300, 30_000).map(lambda n: packed(huge_ids(n))),
    st.builds(deep, st.integers(100, 20_000), st.booleans()),
    st.builds(noise, st.integers(FRAME_LIMIT + 1, 2 * FRAME_LIMIT), st.integers(0, 2 ** 32)),
)
ENVELOPES = st.sampled_from(["ok"] * 12 + ["wrong_key", "no_key", "extra_frame"])


@dataclass
class Frame:
    build: Callable[[str], bytes]
    envelope: str


FRAMES = st.builds(Frame, BODIES, ENVELOPES)


# ---------------------------------------------------------------- the oracle

@dataclass
class Expect:
    errors: Counter = field(default_factory=Counter)     # rid -> ErrorMsgs due (undecodable frames)
    answered: set = field(default_factory=set)            # rids of valid requests: >= 1 answer each
    dropped: int = 0                                      # valid Aborts (of unknown ids): no reply


def parts(frame: Frame, rid: str) -> tuple[list[bytes], str | None, str | None]:
    """The multipart message, the rid its error reply carries (None: no error), and the rid of a
    valid request that gets an answer (None: no answer is due)."""
    body = frame.build(rid)
    if frame.envelope == "wrong_key":
        return [b"not-the-key", body], "", None
    if frame.envelope == "no_key":
        return [body], "", None
    if frame.envelope == "extra_frame":
        return [KEY.encode(), body, b"more"], "", None
    try:
        msg = P.decode(body, P.CLIENT_REQUESTS, FRAME_LIMIT)
    except P.ProtocolError as exc:
        return [KEY.encode(), body], exc.rid, None
    return [KEY.encode(), body], None, None if isinstance(msg, P.Abort) else msg.rid


def send_batch(sock, frames: list[Frame], batch: int) -> Expect:
    expect = Expect()
    for i, frame in enumerate(frames):
        rid = f"fz{batch}-{i}"
        multipart, error_rid, answered_rid = parts(frame, rid)
        sock.send_multipart(multipart)
        if error_rid is not None:
            expect.errors[error_rid] += 1
        elif answered_rid is not None:  # the frame's own rid, or one hypothesis drew
            expect.answered.add(answered_rid)
        else:
            expect.dropped += 1
    return expect


def collect(sock, ok_rid: str, expect: Expect) -> tuple[Counter, set, P.Finished]:
    """Replies until the closing generate's answer is in and every valid request is answered."""
    errors, answered, ok = Counter(), set(), None
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while ok is None or not expect.answered <= answered:
        assert sock.poll(max(0, int((deadline - time.monotonic()) * 1000))), (
            f"no reply: waiting for {sorted(expect.answered - answered)[:5]}, ok={ok is not None}")
        msg = P.decode(sock.recv_multipart()[-1])
        if msg.rid == ok_rid:
            ok = msg
        elif isinstance(msg, P.ErrorMsg) and msg.rid not in expect.answered:
            errors[msg.rid] += 1
        elif isinstance(msg, TERMINAL):
            answered.add(msg.rid)
    return errors, answered, ok


def closing_generate(sock, batch: int) -> str:
    rid = f"ok-{batch}"
    req = P.GenerateReq(rid=rid, input_ids=[5, 6], params=SamplingParams(
        temperature=0.0, max_new_tokens=OK_TOKENS, ignore_eos=True))
    sock.send_multipart([KEY.encode(), P.encode(req)])
    return rid


# ---------------------------------------------------------------- the tests

def test_fuzzed_frames_are_answered_or_dropped_and_the_server_keeps_serving(server, sock):
    counter = itertools.count()
    sent = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames=st.lists(FRAMES, min_size=BATCH, max_size=BATCH))
    def batch(frames):
        n = next(counter)
        expect = send_batch(sock, frames, n)
        errors, _, ok = collect(sock, closing_generate(sock, n), expect)
        assert errors == expect.errors, (errors - expect.errors, expect.errors - errors)
        assert isinstance(ok, P.Finished) and len(ok.token_ids) == OK_TOKENS, ok
        sent.update(frames=len(frames), errors=sum(expect.errors.values()), answered=len(expect.answered),
                    dropped=expect.dropped)

    batch()
    assert sent["frames"] >= MIN_FRAMES
    assert min(sent["errors"], sent["answered"], sent["dropped"]) > 0, sent  # the oracle saw each kind
    assert server.proc.poll() is None and all(map(alive, server.children))


def test_a_frame_past_the_hard_cap_drops_the_connection_and_the_client_reconnects(server, sock):
    """Past 4x the frame limit ZeroMQ itself drops the connection (no reply); the DEALER
    reconnects, and its next request is served."""
    sock.send_multipart([KEY.encode(), b"\x00" * (4 * FRAME_LIMIT + 1)])
    time.sleep(0.5)  # the drop and the reconnect
    rid = closing_generate(sock, -1)
    assert sock.poll(REPLY_TIMEOUT_S * 1000), "no reply after the reconnect"
    msg = P.decode(sock.recv_multipart()[-1])
    assert msg.rid == rid and isinstance(msg, P.Finished) and len(msg.token_ids) == OK_TOKENS, msg
