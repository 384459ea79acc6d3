"""Oversubscription on the default model in float32: with KV for a quarter of the working set
(every request's prompt + max_new_tokens, summed), all requests still complete, through
retraction and recompute, and every greedy output is token for token the one a large pool gives.
"""
import pytest

import stemma
from stemma import SamplingParams

SHARED = ("The committee met on a grey morning to review the harbour project. The engineers "
          "presented three plans for the new breakwater, each with its own cost and schedule. ")
QUESTIONS = ["Which plan was the cheapest, and why?", "Who objected to the second plan?",
             "Describe the weather that morning.", "What did the mayor say at the end?",
             "List the risks the engineers named.", "How long would the third plan take?"]
OTHERS = ["Once upon a time in a small village by the sea, there lived an old fisherman who",
          "The recipe calls for two cups of flour, one egg, and a pinch of salt. First,"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
ENGINE = dict(dtype="float32", quantization="none", max_running_requests=16, chunked_prefill_size=64)


def prompts() -> list[str]:
    return [SHARED + q for q in QUESTIONS] + OTHERS


def needs(engine) -> list[int]:
    """KV slots each request holds at its end: prompt + max_new_tokens."""
    return [len(engine.tokenizer(p).input_ids) + GREEDY.max_new_tokens for p in prompts()]


@pytest.fixture(scope="module")
def reference():
    """The outputs with a pool that holds everything at once, and each request's KV need."""
    engine = stemma.Engine(**ENGINE, kv_pool_tokens=16384)
    outs = engine.generate(prompts(), GREEDY)
    assert engine.stats()["retractions"] == 0
    engine.check_pool_whole()
    return [o.token_ids for o in outs], needs(engine)


def test_a_quarter_of_the_working_set_completes_every_request_with_identical_outputs(reference):
    expected, need = reference
    pool = sum(need) // 4
    assert max(need) < pool < sum(need) // 3, need  # each request fits alone; all of them do not
    engine = stemma.Engine(**ENGINE, kv_pool_tokens=pool)
    outs = engine.generate(prompts(), GREEDY)
    assert [o.finish_reason for o in outs] == ["length"] * len(outs)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats["retractions"] > 0, stats  # the pool really ran dry
    assert sum(o.meta["retractions"] for o in outs) == stats["retractions"]
    engine.check_pool_whole()
