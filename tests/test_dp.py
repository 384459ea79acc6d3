"""Data-parallel replicas behind one gateway (issue 20), served on a tiny llama: 64 concurrent
streams give one engine's greedy outputs, a killed replica fails only its own requests while the
other serves on, and it comes back."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import stemma
from stemma.serve.router import Routing
from tests.served import ENGINE, outcomes, replica_pids, wait_replaced
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

GREEDY = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
LONG = dict(temperature=0.0, max_new_tokens=1500, ignore_eos=True)  # runs for seconds


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("dp_llama"))
    return str(save_tiny_tokenizer(path))


def prompts() -> list[list[int]]:
    """64 prompts over 8 shared prefixes, so that the router has prefixes to follow."""
    return [[3 + p, 9, 4 + p, 11, 5, 60 + i % 20, 7 + i] for i in range(64) for p in [i % 8]]


async def stream_all(client, prompts) -> list[str]:
    async def one(prompt):
        return "".join([delta async for delta in client.astream(prompt, GREEDY, timeout=120)])
    return await asyncio.gather(*[one(p) for p in prompts])


def test_64_streams_over_two_replicas_equal_one_engine(folder):
    with stemma.Runtime(folder, **ENGINE) as one:
        expected = asyncio.run(stream_all(one.client, prompts()))
    with stemma.Runtime(folder, dp=2, **ENGINE) as two:
        got = asyncio.run(stream_all(two.client, prompts()))
        stats = two.client.info()["stats"]
        shares = [sorted(os.sched_getaffinity(r["pid"])) for r in stats["replicas"]]
    assert got == expected
    router = stats["router"]
    assert router["policy"] == "cache_aware" and sum(router["routed"]) == 64
    assert all(router["routed"]), router  # both replicas served
    assert [r["replica"] for r in stats["replicas"]] == [0, 1]
    assert stats["pool_whole"] is True
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # each on its own share of the cores
        assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == cpus


def test_a_killed_replica_fails_only_its_requests_and_comes_back(folder):
    with stemma.Runtime(folder, dp=2, routing=Routing(router="round_robin"), **ENGINE) as rt:
        client = rt.client
        before = replica_pids(client)
        # round robin: streams 0 and 2 on replica 0, 1 and 3 on replica 1
        streams = [client.stream([5, 6, 7 + i], LONG, timeout=60) for i in range(4)]
        firsts = [next(iter(s)) for s in streams]
        assert all(isinstance(f, str) for f in firsts)
        os.kill(before[1], signal.SIGKILL)
        outcome = outcomes(streams)
        assert [o[0] for o in outcome] == ["done", "engine_dead", "done", "engine_dead"], outcome
        assert "replica 1: the engine process was killed by signal 9" in outcome[1][1]
        # the other replica serves on, while replica 1 restarts
        assert client.generate([5, 6], GREEDY, timeout=60).token_ids
        pids = wait_replaced(client, before, 1, timeout=120)
        assert pids[0] == before[0]
        outs = [client.generate([5, 6, 9], GREEDY, timeout=60) for _ in range(2)]  # one on each
        assert outs[0].token_ids == outs[1].token_ids
        assert client.info()["stats"]["router"]["routed"][1] >= 3


def test_health_flush_and_a_program_s_end_answer_for_every_replica(folder):
    """One stalled replica does not fail the server's health (the probe went to one replica);
    a flush while a replica is busy drops no replica's cache (the idle one flushed alone, and
    the answer said "not flushed"); under round robin a program's end reaches every replica its
    calls went to (it reached the last one's alone, and the others kept its KV retained)."""
    from stemma.program_call import ProgramCall
    with stemma.Runtime(folder, dp=2, routing=Routing(router="round_robin"), radix_eviction="program",
                        **ENGINE) as rt:
        client = rt.client
        for i in range(2):  # one call of program p on each replica
            client.generate([5, 6, 9, i], GREEDY, timeout=60, call=ProgramCall("p", i, continues=True))
        stream = client.stream([5, 6, 7], LONG, timeout=60)  # on replica 0
        assert isinstance(next(iter(stream)), str)
        assert client.flush_cache() is False
        replicas = client.info()["stats"]["replicas"]
        assert all(r["pool_cached"] > 0 for r in replicas), replicas
        assert [r["programs_live"] for r in replicas] == [1, 1]
        client.end_program("p")
        client.abort(stream.rid)
        pids = replica_pids(client)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            assert client.health(timeout=5)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        deadline = time.monotonic() + 30
        while any(r["programs_live"] for r in client.info()["stats"]["replicas"]):
            assert time.monotonic() < deadline, client.info()["stats"]["replicas"]
            time.sleep(0.1)
        while not client.flush_cache():  # once the aborted stream's end is back: idle
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert all(r["pool_cached"] == 0 for r in client.info()["stats"]["replicas"])
