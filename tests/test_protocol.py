"""The wire codec: every message round-trips, and every malformed frame is a ProtocolError."""
import subprocess
import sys

import msgpack
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from stemma import protocol as P
from stemma.serve.peer_watch import PeerWatch
from stemma.sampling_params import SamplingParams

EXAMPLES = [
    P.GenerateReq(rid="a", prompt="héllo", params=SamplingParams(max_new_tokens=3, stop=["x"], seed=7),
                  stream=True, salt="s"),
    P.GenerateReq(rid="b", input_ids=[1, 2, 3], params=SamplingParams(n=2, logprobs=True, top_logprobs=2)),
    P.GenerateReq(rid="c", input_ids=[1], params=SamplingParams(n=2), stream=True, program="qa"),
    P.Abort(rid="a"), P.FlushCache(rid="f"), P.GetInfo(rid="i"), P.GetInfo(rid="j", check_pool=False),
    P.GetCacheTree(rid="t", limit=5), P.Health(rid="h"),
    P.TokenChunk(rid="a", index=1, token_ids=[4], text="x", logprobs=[-0.5], top_logprobs=[[(4, -0.5), (9, -2.0)]]),
    P.Finished(rid="a", token_ids=[4, 5], text="xy", finish_reason="stop", prompt_logprobs=[None, -1.5],
               meta={"ttft": None, "latency": 0.25, "prompt_tokens": 3}),
    P.ErrorMsg(rid="", code=P.BAD_REQUEST, message="no"),
    P.ErrorMsg(rid="r", code=P.BAD_REQUEST, message="logit_bias holds token ids outside [0, 96)", param="logit_bias"),
    P.FlushDone(rid="f", ok=False),
    P.Info(rid="i", model="m", context_length=2048, vocab_size=96, stats={"pool_whole": True}),
    P.CacheTree(rid="t", nodes=[{"id": 1, "parent": None, "tokens": [3, 4], "depth": 2, "size": 2,
                                 "hits": 1, "locks": 0}],
                requests=[{"rid": "g1", "state": "running", "prompt_tokens": 2, "output_tokens": 1,
                           "cached_tokens": 0}]),
    P.HealthOk(rid="h"),
    P.EngineReady(model="m", context_length=8, vocab_size=96),
    P.EngineReady(model="m", context_length=8, vocab_size=96, pid=7, eos_token_ids=[1, 95]),
    P.Batch(items=[P.TokenChunk(rid="a", token_ids=[1]), P.Finished(rid="a", token_ids=[1], finish_reason="length"),
                   P.ErrorMsg(rid="b", code=P.BAD_REQUEST, message="bad")]),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.TAG)
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


@given(ids=st.lists(st.integers(0, 2**31), min_size=1, max_size=50), text=st.text(max_size=40),
       max_new=st.integers(0, 1000), temperature=st.floats(0, 5), stream=st.booleans(),
       salt=st.none() | st.text(max_size=10))
@settings(max_examples=60, deadline=None)
def test_generate_round_trip(ids, text, max_new, temperature, stream, salt):
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, stop=[text] if text else None)
    for msg in (P.GenerateReq(rid="r", input_ids=ids, params=params, stream=stream, salt=salt),
                P.GenerateReq(rid="r", prompt=text, params=params, stream=stream, salt=salt)):
        assert P.decode(P.encode(msg)) == msg


def wire(**fields):
    return msgpack.packb({"version": P.PROTOCOL_VERSION, **fields})


GOOD = P.encode(P.GenerateReq(rid="q", input_ids=[1, 2]))
BAD = {
    "garbage": (b"\xc1\xc1 not msgpack", "", "msgpack"),
    "truncated": (GOOD[:-3], "", "msgpack"),
    "not_a_map": (msgpack.packb([1, 2]), "", "must be a map"),
    "int_key": (msgpack.packb({1: 2}), "", "msgpack"),
    "unknown_type": (wire(type="launch", rid="q"), "q", "unknown message type 'launch'"),
    "wrong_version": (msgpack.packb({"type": "abort", "version": 99, "rid": "q"}), "q", "version 99"),
    "missing_field": (wire(type="abort"), "", "missing fields rid"),
    "unknown_field": (wire(type="abort", rid="q", extra=1), "q", "unknown fields extra"),
    "ids_not_list": (wire(type="generate", rid="q", input_ids="abc"), "q", "generate.input_ids must be list[int]"),
    "bool_id": (wire(type="generate", rid="q", input_ids=[1, True]), "q", "generate.input_ids[1] must be int"),
    "negative_max_new": (wire(type="generate", rid="q", input_ids=[1], params={"max_new_tokens": -1}), "q",
                         "max_new_tokens must be >= 0"),
    "unknown_param": (wire(type="generate", rid="q", input_ids=[1], params={"temp": 1}), "q", "temp"),
    "both_prompts": (wire(type="generate", rid="q", input_ids=[1], prompt="x"), "q", "exactly one"),
    "empty_ids": (wire(type="generate", rid="q", input_ids=[]), "q", "at least one token"),
    "long_program": (wire(type="generate", rid="q", input_ids=[1], program="p" * 300), "q", "program must hold"),
    "empty_rid": (wire(type="abort", rid=""), "", "rid must hold"),
    "deep_nesting": (b"\x91" * 5000, "", "msgpack"),
    "ext_type": (msgpack.packb(msgpack.ExtType(5, b"x")), "", "msgpack"),
    "nested_wrong": (wire(type="batch", items=[{"type": "abort", "version": 1, "rid": "x"}]), "",
                     "batch.items[0] must be"),
}


@pytest.mark.parametrize("name", BAD)
def test_malformed_frames_are_protocol_errors(name):
    frame, rid, words = BAD[name]
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frame)
    assert info.value.rid == rid
    assert words in str(info.value)


def test_size_limit_and_allowed_types():
    with pytest.raises(P.ProtocolError, match="over the limit of 100 bytes"):
        P.decode(P.encode(P.GenerateReq(rid="q", prompt="x" * 200)), max_bytes=100)
    with pytest.raises(P.ProtocolError, match="not accepted here") as info:
        P.decode(P.encode(P.HealthOk(rid="h")), P.CLIENT_REQUESTS)
    assert info.value.rid == "h"


def test_peer_watch_names_the_client_that_disconnected():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    watch = PeerWatch(router)
    dealers = [ctx.socket(zmq.DEALER) for _ in range(2)]
    identities = []
    for d in dealers:
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(b"hi")
        peer, body = router.recv_multipart(copy=False)
        watch.seen(peer.bytes, body)
        identities.append(peer.bytes)
    assert watch.gone() == []
    dealers[0].close(linger=0)
    assert watch.monitor.poll(5000)
    assert watch.gone() == [identities[0]]
    dealers[1].close(linger=0)
    assert watch.monitor.poll(5000)
    assert watch.gone() == [identities[1]]
    watch.close()
    router.close(linger=0)
    ctx.term()


def test_the_client_does_not_import_torch():
    code = ("import sys, stemma; stemma.connect('tcp://127.0.0.1:9').close(); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_sampling_params_travel_without_their_defaults():
    """A field at its default is left off the wire: a side that predates the field (an older
    gateway, whose SamplingParams refuses unknown fields) still reads the request."""
    from stemma.protocol.codec import to_wire
    plain = P.GenerateReq(rid="r", input_ids=[1])
    assert to_wire(plain)["params"] == {}
    set_ = P.GenerateReq(rid="r", input_ids=[1], params=SamplingParams(temperature=0.0, stop=["\n"]))
    assert to_wire(set_)["params"] == {"temperature": 0.0, "stop": ["\n"]}
    assert P.decode(P.encode(set_)) == set_ and P.decode(P.encode(plain)) == plain


def test_an_error_names_its_field_from_version_5_only():
    """ErrorMsg.param (version 5): written at version 5 when set, at version 1 otherwise, and a
    message that claims an older version may not carry it."""
    assert P.ErrorMsg(rid="r", code=P.BAD_REQUEST, message="no").wire_version() == 1
    assert P.ErrorMsg(rid="r", code=P.BAD_REQUEST, message="no", param="stop").wire_version() == 5
    old = msgpack.packb({"type": "error", "version": 4, "rid": "r", "code": P.BAD_REQUEST, "message": "no",
                         "param": "stop"})
    with pytest.raises(P.ProtocolError, match="needs protocol version 5"):
        P.decode(old)


def test_only_an_ipv6_literal_takes_ipv6():
    """zmq.IPV6 makes libzmq resolve a host name to its IPv6 address first: tcp://localhost would
    reach ::1 where /etc/hosts lists it, while the server listens on 127.0.0.1."""
    from stemma.protocol.transport import ipv6_literal
    assert ipv6_literal("tcp://[::1]:30001") and ipv6_literal("tcp://[fe80::1]:1")
    assert not any(ipv6_literal(a) for a in ("tcp://localhost:30001", "tcp://127.0.0.1:30001",
                                             "tcp://example.com:1", "ipc:///tmp/x"))
