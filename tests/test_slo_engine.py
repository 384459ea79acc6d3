"""Priority preemption and latency targets in a real engine (tiny random llama with the ByteLevel
test tokenizer, float32): the preempted requests, constrained, speculative and n > 1 among them,
give exactly the outputs they give without preemption; the pool is whole; targets are scored."""
import re
from types import SimpleNamespace

import pytest

import stemma
from stemma import SamplingParams
from stemma.engine import warmup
from tests.bytelevel_tokenizer import build_tiny_bytelevel


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_bytelevel(tmp_path_factory.mktemp("tiny_bytelevel_slo")))


def make(folder, **kw):
    cfg = dict(dtype="float32", kv_pool_tokens=4096, max_running_requests=4, attention_backend="torch",
               speculative="ngram")
    return stemma.Engine(folder, **{**cfg, **kw})


def low_priority():
    """Four requests that fill a batch of 4: plain, regex-constrained, n = 2 (two sequences)."""
    return [([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)),
            ([11, 12, 13], SamplingParams(regex=r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", temperature=0,
                                          max_new_tokens=40)),
            ([20, 21, 22, 23], SamplingParams(temperature=0.8, seed=3, n=2, max_new_tokens=30,
                                              ignore_eos=True))]


URGENT = ([40, 41, 42], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, priority=10))


def outputs(engine, reqs):
    return [(r.rid, r.output_ids, r.finish_reason) for r in reqs]


def test_preempted_requests_lose_nothing(folder):
    ref_engine = make(folder)
    ref = [r for ids, p in low_priority() for r in ref_engine.submit(ids, p)]
    ref_engine.run_until_done(ref)
    (ref_urgent,) = ref_engine.submit(*URGENT)
    ref_engine.run_until_done([ref_urgent])

    engine = make(folder)
    low = [r for ids, p in low_priority() for r in engine.submit(ids, p)]
    assert len(low) == 4
    for _ in range(6):
        engine.step()
    assert all(r.row is not None for r in low)   # the batch is full
    (urgent,) = engine.submit(*URGENT)
    engine.step()
    assert urgent.output_ids                     # admitted and prefilled at once: its first token
    assert engine.stats()["preemptions"] == 1
    assert sum(r.retractions for r in low) == 1
    engine.run_until_done(low + [urgent])
    assert [r.output_ids for r in low] == [r.output_ids for r in ref]
    assert urgent.output_ids == ref_urgent.output_ids
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", engine.output(low[1]).text)
    engine.check_pool_whole()


def plain(n, seed, priority=0):
    ids = [3 + (seed * 31 + 7 * i) % 90 for i in range(n)]
    return ids, SamplingParams(temperature=0, max_new_tokens=200 if priority == 0 else 40,
                               ignore_eos=True, priority=priority)


def test_a_kv_short_urgent_request_is_admitted_by_the_preemptions_it_causes(folder):
    """KV, not the batch, is short: preemption counts what admission will need (a decode slot
    per running request, the KV reserve, the urgent request's cached prefix locked), so the
    request it makes room for is admitted in that step, and no request is retracted in vain."""
    engine = make(folder, kv_pool_tokens=512, chunked_prefill_size=64, speculative="none")
    low = [engine.submit(*plain(60, i))[0] for i in range(4)]
    for _ in range(40):
        engine.step()
    assert len(engine.scheduler.running) == 4 and not engine.scheduler.waiting
    (urgent,) = engine.submit(*plain(100, 9, priority=20))
    engine.step()
    # 400 of 512 slots held; admission needs 64 (a chunk) + 4 decode slots + the reserve, 0.3 x
    # (4 x 160 + 40) = 204: each preemption frees ~100 and lowers the need by ~49, so two
    assert urgent.admitted_once and engine.stats()["preemptions"] == 2
    assert sum(r.row is not None for r in low) == 2
    engine.run_until_done(low + [urgent])
    engine.check_pool_whole()


def test_the_pool_running_dry_retracts_the_lowest_priority_first(folder):
    """A retraction for KV (not a preemption) takes the lowest priority first, then the least
    progress: the urgent request, newest and least advanced, was taken first, again and again."""
    engine = make(folder, kv_pool_tokens=256, chunked_prefill_size=64, kv_reserve_ratio=0.0,
                  speculative="none")
    low = [engine.submit(*plain(20, i))[0] for i in range(3)]
    for _ in range(30):
        engine.step()
    (urgent,) = engine.submit(*plain(40, 9, priority=20))
    engine.run_until_done([urgent])
    assert urgent.retractions == 0 and sum(r.retractions for r in low) > 0
    engine.run_until_done(low)
    engine.check_pool_whole()


def test_targets_are_scored_in_the_output_and_stats(folder):
    engine = make(folder, default_itl_slo_ms=10_000.0)
    engine.warm_up_step_cost()
    out = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                    ttft_slo_ms=0.001, priority=3))
    slo = out.meta["slo"]
    assert slo["priority"] == 3 and slo["itl_met"] and not slo["ttft_met"] and not slo["met"]
    assert engine.stats()["slo"] == {"3": {"requests": 1, "ttft_met": 0, "itl_met": 1, "met": 0}}
    cost = engine.stats()["step_cost"]
    assert cost["steps"] >= 8 and cost["base_ms"] >= 0 and cost["median_abs_error"] is not None
    plain = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4))
    assert plain.meta["slo"]["itl_target_ms"] == 10_000.0   # the engine's default target applies
    engine.check_pool_whole()


def test_warm_up_seeds_the_one_row_step_and_writes_no_request_kv(folder):
    engine = make(folder, default_itl_slo_steps=2.0)
    slo = engine.scheduler.slo
    assert slo.one_row_s is not None and slo.one_row_s > 0
    assert engine.step_cost.ready
    assert engine.stats()["pool_free"] == engine.stats()["pool_total"]
    out = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4))
    assert out.meta["slo"]["itl_target_ms"] == pytest.approx(2e3 * slo.one_row_s, abs=0.01)


def test_warm_up_takes_no_sample_from_a_forward_that_held_a_one_off_job(folder):
    """A forward that ran a row-ops trial or compiled a decode graph (compile_decode=on compiles in
    the step that first meets a bucket) took seconds that no later step will: it seeds no cost."""
    engine = make(folder)
    runner, compiles = engine.runner, []
    forward = runner.forward

    def compiling_first(fb):  # the first one-row forward compiles, as under compile_decode=on
        if not compiles:
            compiles.append(fb)
        return forward(fb)
    runner.forward = compiling_first
    runner.one_offs = lambda: len(compiles)
    seen = []
    cost = SimpleNamespace(observe=lambda shape, seconds: seen.append(shape))
    warmup.warm_up(runner, cost)
    assert len(seen) == len(warmup.SHAPES) - 1
    engine.check_pool_whole()


def test_a_latency_target_caps_what_speculation_verifies_in_a_step(folder):
    """A verify step is the gap before its tokens: drafts that would take the step past the ITL
    target are not made (here no step fits the target, so none is), and outputs do not change."""
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    runs = {}
    for target in (10_000.0, 0.001):
        engine = make(folder, default_itl_slo_ms=target)
        engine.warm_up_step_cost()
        runs[target] = (engine.generate(prompt, params).token_ids, engine.stats()["spec_proposed"])
        engine.check_pool_whole()
    assert runs[10_000.0][1] > 0       # loose: the n-gram drafts are verified
    assert runs[0.001][1] == 0         # tight: none
    assert runs[0.001][0] == runs[10_000.0][0]
