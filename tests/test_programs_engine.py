"""Program-aware scheduling and KV retention (issue 19) on an in-process Engine (a tiny random llama
with a word tokenizer): what the frontend sends, what the engine keeps, and that outputs do not
change."""
import time

import pytest

import stemma
from stemma import SamplingParams
from stemma.engine.process import EngineLoop
from stemma.lang.backends.engine import EngineBackend
from stemma.program_call import ProgramCall
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

W = words()
GREEDY = dict(temperature=0)
OPTIONS = dict(dtype="float32", attention_backend="torch", max_running_requests=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("programs_llama"))
    return str(save_tiny_tokenizer(path))


def sentence(n, seed=0):
    return " ".join(W[(seed + 7 * i + i * i) % len(W)] for i in range(n))


@stemma.tool
def lookup(topic):
    time.sleep(0.05)
    return sentence(4, seed=len(topic))


@stemma.function
def agent(s, topic):
    s += sentence(10) + " " + topic
    s += stemma.gen("plan", max_new_tokens=6, ignore_eos=True)
    s += " " + lookup(topic)
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += " " + W[20 + i] + stemma.gen("idea", max_new_tokens=5, ignore_eos=True)
    forks.join()
    s += " " + W[9] + stemma.gen("answer", max_new_tokens=6, ignore_eos=True)


def recorded_calls(engine):
    """Wraps engine.submit to keep the ProgramCall of every request."""
    seen, submit = [], engine.submit

    def spy(*args, call=None, **kwargs):
        seen.append(call)
        return submit(*args, call=call, **kwargs)
    engine.submit = spy
    return seen


def test_a_program_sends_its_context_and_ends_and_its_outputs_do_not_change(folder):
    plain = stemma.Engine(folder, **OPTIONS)
    aware = stemma.Engine(folder, schedule_policy="program", radix_eviction="program", **OPTIONS)
    seen = recorded_calls(aware)
    outs = [agent.run(topic=W[40], backend=EngineBackend(e), sampling=GREEDY) for e in (plain, aware)]
    assert outs[0].text() == outs[1].text() and outs[0]["idea"] == outs[1]["idea"]

    pid = seen[0].program_id
    assert all(c is not None and c.program_id == pid and c.continues for c in seen)
    indexes = [c.call_index for c in seen]
    assert indexes[0] == 0 and sorted(set(indexes)) == list(range(max(indexes) + 1))
    fork_prefill = indexes[1]  # plan, then the fork's prefill, then the two branches, the answer
    branches = [c for c in seen if c.fork_parent is not None]
    assert len(branches) == 2 and all(c.fork_parent == fork_prefill for c in branches)
    assert seen[0].pause_s is None and seen[-1].pause_s == pytest.approx(0.05, abs=0.04)  # after the tool

    rec = aware.programs.records[pid]
    assert rec.ended and rec.calls == len(seen) and rec.in_flight == 0  # EndProgram came at the end
    assert rec.attained >= rec.prompt_tokens - rec.cached_tokens + rec.generated_tokens - rec.calls
    assert rec.generated_tokens == 6 + 5 + 5 + 6 and rec.cached_tokens > 0
    stats = aware.stats()
    assert stats["programs_ended"] == 1 and stats["programs_live"] == 0
    assert stats["programs"][0]["program_id"] == pid and stats["programs"][0]["calls"] == len(seen)
    assert len(plain.programs.records) == 1  # kept for stats whatever the policy; orders nothing
    for e in (plain, aware):
        e.check_pool_whole()


def prompt(engine, n, seed):
    return engine.tokenizer(sentence(n, seed), add_special_tokens=False).input_ids


@pytest.mark.parametrize("eviction", ["lru", "program"])
def test_a_paused_programs_kv_outlives_other_traffic_only_under_program_eviction(folder, eviction):
    engine = stemma.Engine(folder, kv_pool_tokens=320, radix_eviction=eviction, **OPTIONS)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, **GREEDY)
    first = prompt(engine, 100, 1)
    (a,) = engine.submit(first, params, call=ProgramCall("agent", 0, pause_s=20.0))
    engine.run_until_done([a])
    for seed in range(2, 7):  # plain requests while the agent is in its tool call: 5 x ~60 tokens
        (r,) = engine.submit(prompt(engine, 60, seed * 13), params)
        engine.run_until_done([r])
    (b,) = engine.submit(a.tokens + prompt(engine, 10, 99), params, call=ProgramCall("agent", 1))
    engine.run_until_done([b])
    engine.check_pool_whole()
    kept = b.cached_tokens >= len(first)
    assert kept == (eviction == "program"), (b.cached_tokens, len(first))
    engine.end_program("agent")
    assert engine.programs.records["agent"].ended


def test_the_program_policy_serves_a_resumed_call_before_new_programs(folder):
    engine = stemma.Engine(folder, schedule_policy="program", max_prefill_tokens=64,
                           chunked_prefill_size=64, **OPTIONS)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, **GREEDY)
    (a,) = engine.submit(prompt(engine, 30, 1), params, call=ProgramCall("old", 0))
    engine.run_until_done([a])
    news = [engine.submit(prompt(engine, 40, 10 + i), params, call=ProgramCall(f"new{i}", 0))[0]
            for i in range(3)]
    (b,) = engine.submit(a.tokens + prompt(engine, 5, 77), params, call=ProgramCall("old", 1))
    engine.step()  # one step admits what fits 64 prefill tokens: the resumed call goes first
    assert b.admitted_once and not news[-1].admitted_once
    engine.run_until_done(news + [b])
    engine.check_pool_whole()


def test_an_idle_engine_holding_a_call_for_retained_kv_sleeps_until_the_retention_ends(folder):
    """Nothing runs and the only waiting call would evict a paused program's KV: the scheduler
    holds it and its idle timeout reaches to the retention's end; after it, the call runs."""
    from stemma.engine.scheduler import IDLE_WAIT_S
    engine = stemma.Engine(folder, kv_pool_tokens=64, schedule_policy="program",
                           radix_eviction="program", **OPTIONS)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0)
    (a,) = engine.submit(list(range(10, 50)), params, call=ProgramCall("agent", 0, pause_s=0.4))
    engine.run_until_done([a])
    (b,) = engine.submit(list(range(60, 90)), params, call=ProgramCall("other", 0))
    start = time.perf_counter()
    assert engine.step() == [] and not b.admitted_once
    assert engine.idle_timeout() > 10 * IDLE_WAIT_S
    loop = EngineLoop(engine, requests=None, outputs=None)  # the server's loop dozes as long
    loop.next_beat = time.monotonic() + 1.0
    assert 10 < loop.doze_ms() <= 1000
    loop.next_beat = time.monotonic() + 0.005  # but never past its next heartbeat
    assert loop.doze_ms() <= 5
    engine.run_until_done([b])
    assert time.perf_counter() - start >= 0.4  # 1.5 x 0.4 s + 0.1 s of retention, less the steps
    engine.check_pool_whole()
