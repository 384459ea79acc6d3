"""Bounded resources for hostile input (issue 17): each limit is an engine option, a request past
it fails at submission with a ValueError naming the limit and its flag, and the engine goes on
serving. A constraint that compiles for too long fails its request at constraint_timeout_s
without holding up the batch or later constraints."""
import argparse
import time

import pytest

import stemma
from stemma import SamplingParams
from stemma.cli_args import add_dataclass_args, collect
from stemma.engine_config import EngineConfig
from stemma.executor import executor
from tests.bytelevel_tokenizer import build_tiny_bytelevel
from tests.served import ENGINE
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
LIMITS = dict(max_prompt_tokens=40, max_new_tokens_limit=50, max_n=3, max_stop_strings=2,
              max_stop_chars=8, max_logit_bias=2, max_prompt_logprobs=20)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("limits_llama"))))


@pytest.fixture(scope="module")
def engine(folder):
    return stemma.Engine(folder, **{**ENGINE, "kv_pool_tokens": 1024, "speculative": "none", **LIMITS})


def still_serving(engine):
    out = engine.generate(PROMPT, GREEDY)
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_new_tokens
    engine.check_pool_whole()
    assert engine.stats()["queue"] == 0 and engine.stats()["running"] == 0


OVER = {  # limit -> (prompt, params) just past it; at the limit itself the request is taken
    "max_prompt_tokens": (list(range(4, 45)), {}, (list(range(4, 44)), {})),
    "max_new_tokens_limit": (PROMPT, {"max_new_tokens": 51}, (PROMPT, {"max_new_tokens": 50})),
    "max_n": (PROMPT, {"n": 4}, (PROMPT, {"n": 3})),
    "max_stop_strings": (PROMPT, {"stop": ["a", "b", "c"]}, (PROMPT, {"stop": ["a", "b"]})),
    "max_stop_chars": (PROMPT, {"stop": ["x" * 9]}, (PROMPT, {"stop": ["x" * 8]})),
    "max_logit_bias": (PROMPT, {"logit_bias": {4: 1.0, 5: 1.0, 6: 1.0}},
                       (PROMPT, {"logit_bias": {4: 1.0, 5: 1.0}})),
    "max_prompt_logprobs": (list(range(4, 30)), {"logprob_start": 5},
                            (list(range(4, 30)), {"logprob_start": 6})),
}


@pytest.mark.parametrize("limit", list(OVER))
def test_each_limit_refuses_past_it_naming_the_option_and_the_engine_goes_on(engine, limit):
    prompt, changes, (ok_prompt, ok_changes) = OVER[limit]
    flag = "--" + limit.replace("_", "-")
    with pytest.raises(ValueError, match=rf"{limit} \({LIMITS[limit]}; the engine option {flag}\)"):
        engine.submit(prompt, GREEDY.replace(**changes))
    assert engine.stats()["queue"] == 0  # nothing was queued
    outs = engine.generate(ok_prompt, GREEDY.replace(**ok_changes))
    for out in outs if isinstance(outs, list) else [outs]:
        assert out.finish_reason in ("length", "stop")
    still_serving(engine)


def test_default_limits_follow_the_context(folder):
    engine = stemma.Engine(folder, **{**ENGINE, "kv_pool_tokens": 256, "speculative": "none"})
    context = engine.runner.max_context
    assert context == 256
    with pytest.raises(ValueError, match=r"prompt of 256 tokens does not fit the context of 256 "
                                         r"tokens \(max_prompt_tokens 255: .*--max-prompt-tokens"):
        engine.submit([5] * context, GREEDY)
    engine.generate([5] * (context - 1), GREEDY)  # at the limit
    # no limit on max_new_tokens unless one is set: the context ends the output
    out = engine.generate(PROMPT, GREEDY.replace(max_new_tokens=10 * context))
    assert out.finish_reason == "length" and len(PROMPT) + len(out.token_ids) == context
    with pytest.raises(ValueError, match="logit_bias holds token ids outside"):
        engine.submit(PROMPT, GREEDY.replace(logit_bias={10_000: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids holds token ids outside"):
        engine.submit(PROMPT, GREEDY.replace(stop_token_ids=[96]))
    still_serving(engine)


def test_limits_are_flags_and_validated_once():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    ns = parser.parse_args(["--max-n", "3", "--max-prompt-tokens", "100", "--constraint-timeout-s", "2.5"])
    got = collect(ns, EngineConfig)
    assert (got["max_n"], got["max_prompt_tokens"], got["constraint_timeout_s"]) == (3, 100, 2.5)
    for bad in ({"max_n": 0}, {"max_logit_bias": -1}, {"max_prompt_tokens": 0},
                {"constraint_timeout_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


def test_prompt_logprobs_are_scored_in_blocks_with_the_same_values(engine, monkeypatch):
    params = GREEDY.replace(logprob_start=0)
    prompt = [(3 * j) % 90 + 4 for j in range(18)]
    whole = engine.generate(prompt, params).prompt_logprobs
    monkeypatch.setattr(executor, "PROMPT_LOGPROB_BLOCK", 5)
    engine.flush_cache()
    blocked = engine.generate(prompt, params).prompt_logprobs
    assert len(blocked) == len(prompt) and blocked[0] is None
    assert blocked[1:] == pytest.approx(whole[1:], abs=1e-5)


# A regex whose DFA doubles with each repetition: about 2 s to check on a byte vocabulary here,
# and its build would take far longer (the DFA has 2**17 states).
PATHOLOGICAL = "(a|b)*a(a|b){17}"


def test_a_pathological_regex_times_out_without_blocking_anything(tmp_path):
    folder = str(build_tiny_bytelevel(tmp_path))  # constrained decoding needs a byte-level vocabulary
    engine = stemma.Engine(folder, **{**ENGINE, "kv_pool_tokens": 1024, "speculative": "none",
                                      "constraint_timeout_s": 0.5})
    started = time.perf_counter()
    (slow,) = engine.submit(PROMPT, GREEDY.replace(regex=PATHOLOGICAL))
    assert time.perf_counter() - started < 1.0  # the check went on in the background
    (plain,) = engine.submit([9, 8, 7], GREEDY)
    (simple,) = engine.submit([4, 5], GREEDY.replace(regex="(a|b)c", max_new_tokens=8))
    engine.run_until_done([plain])
    assert plain.finish_reason == "length"
    engine.run_until_done([slow, simple])
    elapsed = time.perf_counter() - started
    assert slow.finish_reason == "error" and "constraint_timeout_s (0.5 s" in slow.error
    assert slow.error.startswith("regex:") and not slow.fault
    assert simple.finish_reason == "stop", simple.error  # its check ran on a fresh thread
    assert elapsed < 1.5 + 1.0, elapsed  # the timeout, plus one idle wait and the simple build
    assert engine.constrainer.abandoned_builds >= 1
    engine.check_pool_whole()
    still_serving(engine)


def test_timed_out_checks_queued_behind_a_stuck_one_are_skipped(tmp_path):
    folder = str(build_tiny_bytelevel(tmp_path))
    engine = stemma.Engine(folder, **{**ENGINE, "kv_pool_tokens": 1024, "speculative": "none",
                                      "constraint_timeout_s": 0.5})
    same = [engine.submit(PROMPT, GREEDY.replace(regex=PATHOLOGICAL.replace("17", "16")))[0]
            for _ in range(3)]  # each its own check job, queued behind the first
    engine.run_until_done(same)
    assert all(r.finish_reason == "error" and "constraint_timeout_s" in r.error for r in same)
    (simple,) = engine.submit([4, 5], GREEDY.replace(regex="(a|b)c", max_new_tokens=8))
    started = time.perf_counter()
    engine.run_until_done([simple])
    assert simple.finish_reason == "stop" and time.perf_counter() - started < 1.0
    engine.check_pool_whole()
