"""Speculative decoding: n-gram drafts verified inside the continuous batch.

Greedy and seeded outputs must be token-identical with speculation on and off in every engine
setting (the invariance suite of test_engine, in fp32), unseeded sampling must keep the target
distribution (a chi-square test), and the KV pool must be whole after every run. In the engine
tests drafts are forced to their longest (`force_drafts`), so every proposal is verified whatever
the step-cost model would choose; the choice itself is tested on its own.
"""
import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from stemma import SamplingParams
from stemma.cache.radix_tree import RadixTree
from stemma.speculative.cost import StepCost
from stemma.speculative.ngram import NgramIndex
from stemma.speculative.speculation import Speculation
from stemma.speculative.verify import accepted
from tests.test_engine import CASES, GREEDY, finish_clean, folder, make  # noqa: F401 (folder: a fixture)

P_VALUE = 0.001  # the chi-square test fails below this


def repetitive_prompts(n=12, seed=1):
    """Prompts that repeat a phrase, so n-gram drafts hit often; some share a prefix."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 96, (12,), generator=g).tolist()
    out = []
    for i in range(n):
        phrase = torch.randint(3, 96, (3 + i % 5,), generator=g).tolist()
        body = phrase * (2 + i % 4) + torch.randint(3, 96, (i % 7,), generator=g).tolist()
        out.append(shared + body if i % 3 == 0 else body)
    return out


def force_drafts(engine):
    """Every proposal verified at its full length (the cost model is bypassed)."""
    engine.spec.choose = lambda decodes, cands, *_: [most for _, most in cands]
    return engine


@pytest.fixture(scope="module")
def spec_reference(folder):  # noqa: F811
    engine = make(folder)
    ref = [engine.generate(p, GREEDY).token_ids for p in repetitive_prompts()]
    finish_clean(engine)
    return ref


# ---------------------------------------------------------------- the pieces

def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert idx.lookup(tokens, 3) == [7, 5, 1]          # the latest "1 2 3" (4-grams don't match)
    tokens += [7, 6]
    assert idx.lookup(tokens, 4) == []                  # "7 6" never seen before
    tokens += [1, 2]
    assert idx.lookup(tokens, 2) == [3, 7]              # "6 1 2"? no; "1 2" last seen before "3 7"
    assert NgramIndex().lookup([4, 4], 3) == []         # a suffix never matches itself
    assert NgramIndex().lookup([4, 4, 4], 3) == [4, 4, 4]   # the copy runs on past the end
    assert NgramIndex().lookup([5, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]   # period 3
    assert NgramIndex().lookup([5, 1, 2, 3, 1, 2, 3], 2) == [1, 2]
    assert NgramIndex().lookup([1, 2, 3, 9, 1, 2], 6) == [3, 9, 1, 2]   # no loop yet: the copy ends


def test_tree_continuation_is_read_only_and_follows_the_most_hit_child():
    tree = RadixTree()
    slots = lambda n: torch.arange(n)  # noqa: E731
    tree.insert((1, 2, 3, 4, 5), slots(5))
    tree.insert((1, 2, 3, 8, 9), slots(5) + 10)
    version, nodes = tree.version, len(list(tree.nodes()))
    assert tree.continuation((1, 2), None, 3) == [3, 4, 5] or tree.continuation((1, 2), None, 3) == [3, 8, 9]
    hit = tree.match_prefix((1, 2, 3, 8, 9)).node
    tree.record_hit(hit)
    assert tree.continuation((1, 2), None, 3) == [3, 8, 9]
    assert tree.continuation((1, 2, 3, 4), None, 5) == [5]
    assert tree.continuation((1, 7), None, 3) == [] and tree.continuation((5,), None, 3) == []
    assert tree.continuation((1, 2), "other salt", 3) == []
    assert tree.version == version and len(list(tree.nodes())) == nodes


def test_accepted_keeps_drafts_up_to_the_first_mismatch_then_the_sampled_token():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accepted([], [3]) == [3]


def test_step_cost_fit_recovers_the_machine_s_costs():
    cost = StepCost()
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, drafts = int(rng.integers(1, 64)), int(rng.integers(0, 40))
        spec = min(drafts, int(rng.integers(0, 8)))
        cost.observe(rows, drafts, spec, 0.030 + 0.001 * rows + 0.002 * drafts + 0.0005 * spec)
    assert cost.coef() == pytest.approx([0.030, 0.001, 0.002, 0.0005, 0.0], abs=2e-4)
    assert cost.extra(1, 4, 1) == pytest.approx(0.0085, abs=5e-4)
    # plain steps that a compiled graph runs, 8 ms faster: the fit learns the saving (the prior,
    # none, pulls it in a little) and keeps the rest
    for _ in range(300):
        rows = int(rng.integers(1, 64))
        cost.observe(rows, 0, 0, 0.030 + 0.001 * rows - 0.008, compiled=True)
    assert -0.009 < cost.coef()[4] < -0.004
    assert cost.predict(4, 0, 0, compiled=True) == pytest.approx(0.026, abs=1e-3)
    assert cost.coef()[1] == pytest.approx(0.001, abs=1e-4)


def spec_with_cost(a, b, c):
    spec = Speculation.__new__(Speculation)
    spec.cost = StepCost()
    spec.compiled_saving = None
    spec.max_verify_steps = math.inf
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows, drafts = int(rng.integers(1, 64)), int(rng.integers(0, 20))
        spec.cost.observe(rows, drafts, min(drafts, 4), a + b * rows + c * drafts)
    return spec


def test_choose_drafts_long_when_rows_are_cheap_and_none_when_compute_bound():
    cheap = spec_with_cost(0.030, 0.001, 0.001)        # a bandwidth-bound step: weights dominate
    assert cheap.choose(1, [(0.9, 8)]) == [8]
    assert cheap.choose(1, [(0.3, 8)])[0] in (1, 2)     # a poor drafter: a short draft at most
    assert cheap.choose(1, [(0.9, 8), (0.2, 8)])[0] > cheap.choose(1, [(0.9, 8), (0.2, 8)])[1]
    bound = spec_with_cost(0.005, 0.002, 0.002)         # every row costs what a token is worth
    assert bound.choose(64, [(0.5, 8)] * 64) == [0] * 64
    assert cheap.choose(1, []) == []
    assert cheap.choose(1, [(0.9, 8)], max_rows=3) == [3]   # a latency target's cap
    assert cheap.choose(2, [(0.9, 8), (0.8, 8)], max_rows=0) == [0, 0]
    capped = cheap.choose(2, [(0.9, 8), (0.8, 8)], max_rows=5)
    assert sum(capped) == 5 and capped[0] >= capped[1]


def test_a_compiled_plain_step_is_weighed_against_the_eager_verify_step():
    spec = spec_with_cost(0.030, 0.001, 0.001)
    spec.compiled_saving = lambda decodes: 0.025   # the plain step 6 ms: 8 drafts at 0.9 do not pay
    assert spec.choose(1, [(0.9, 8)]) == [0]
    # a step that also prefills runs eager with or without drafts: its graph is not even asked
    # (asking would queue a compile for a batch size that no decode forward may ever have)
    spec.compiled_saving = lambda decodes: pytest.fail("a mixed step asked for a graph's saving")
    assert spec.choose(1, [(0.9, 8)], decode_only=False) == [8]
    # the plain step 16 ms: one draft alone does not pay for the eager step (1.9 tokens in 32 ms),
    # eight do (6.1 tokens in 39 ms)
    spec.compiled_saving = lambda decodes: 0.015
    assert spec.choose(1, [(0.9, 8)]) == [8]
    spec.compiled_saving = lambda decodes: 0.0
    assert spec.choose(1, [(0.9, 8)]) == [8]


def test_a_verify_step_is_bounded_in_one_row_steps():
    spec = spec_with_cost(0.030, 0.001, 0.001)     # the one-row step 31 ms, a draft 1 ms
    assert spec.choose(1, [(0.9, 8)]) == [8]
    spec.max_verify_steps = 1.1                     # 34.1 ms: three drafts
    assert spec.choose(1, [(0.9, 8)]) == [3]
    spec.max_verify_steps = 1.5                     # 46.5 ms: all eight alone ...
    assert spec.choose(1, [(0.9, 8)]) == [8]
    # ... and 12 among 4 decodes (34 ms plain), the likeliest first
    lengths = spec.choose(4, [(0.9, 8), (0.9, 8), (0.5, 8), (0.5, 8)])
    assert sum(lengths) == 12 and lengths[0] + lengths[1] > lengths[2] + lengths[3]
    # 16 decodes: the plain step (46 ms eager) leaves room for none; unbounded, drafts pay
    assert spec.choose(16, [(0.9, 8)] * 16) == [0] * 16
    spec.max_verify_steps = math.inf
    assert sum(spec.choose(16, [(0.9, 8)] * 16)) > 16
    # against a compiled plain step (40 ms), drafts must also pay for the eager jump: the four
    # that fit at 50 ms (19.6 tokens against 16 in 40 ms) do not
    spec.compiled_saving = lambda decodes: 0.006
    assert sum(spec.choose(16, [(0.9, 8)] * 16)) > 16
    spec.max_verify_steps = 50 / 31
    assert sum(spec.choose(16, [(0.9, 8)] * 16)) == 0


def fitted(seed: int, max_rows: int, base: float, per_draft: float, per_speculating: float) -> Speculation:
    """A Speculation whose step-cost fit saw 300 steps of that cost (no cost per decode row),
    unbounded and with no compiled graph until a test sets them."""
    spec = Speculation.__new__(Speculation)
    spec.cost = StepCost()
    spec.compiled_saving = None
    spec.max_verify_steps = math.inf
    rng = np.random.default_rng(seed)
    for _ in range(300):
        rows, drafts = int(rng.integers(1, max_rows)), int(rng.integers(0, 24))
        speculating = min(drafts, int(rng.integers(1, rows + 1)))
        spec.cost.observe(rows, drafts, speculating, base + per_draft * drafts + per_speculating * speculating)
    return spec


def test_deep_drafts_for_a_few_requests_come_before_a_costly_first_draft_for_each():
    # the fit of a 4-stream round on the default model: each speculating request adds 4.7 ms,
    # each draft row 0.3 ms; the compiled plain step saves 8 ms; verify steps bounded at 1.5x
    spec = fitted(seed=2, max_rows=8, base=0.0361, per_draft=0.0003, per_speculating=0.0047)
    spec.compiled_saving = lambda decodes: 0.008
    spec.max_verify_steps = 1.5
    # one first draft each would give 6.97 tokens in 48.7 ms (the fourth is past the bound),
    # below the plain step's 4 in 28 ms; eight drafts for each of two give 19.3 tokens in 50 ms
    lengths = spec.choose(4, [(0.99, 8)] * 4)
    assert sorted(lengths) == [0, 0, 8, 8]
    # with no cost per speculating request the order is by gain: a first draft each, then seconds
    cheap = spec_with_cost(0.030, 0.001, 0.001)
    assert cheap.choose(4, [(0.9, 8), (0.85, 8)], max_rows=2) == [1, 1]


def test_a_first_draft_past_the_bound_is_passed_over_for_a_deeper_one_that_fits():
    # a speculating request costs what a draft row costs (2 ms each); the plain step 30 ms, the
    # bound 41 ms. Best first: 0.7's first (34 ms), its second (0.49, 36 ms) and third (0.343,
    # 38 ms), then 0.65's first, which would need 42 ms; 0.7's fourth (0.24) fits at 40 ms
    spec = fitted(seed=3, max_rows=16, base=0.030, per_draft=0.002, per_speculating=0.002)
    spec.max_verify_steps = 0.041 / 0.030
    assert spec.choose(2, [(0.7, 8), (0.65, 8)]) == [4, 0]
    spec.max_verify_steps = math.inf  # unbounded: both speculate
    assert all(spec.choose(2, [(0.7, 8), (0.65, 8)]))


# ---------------------------------------------------------------- the engine
def test_steps_slowed_by_a_background_compile_stay_out_of_the_cost_fit(folder):  # noqa: F811
    engine = make(folder, speculative="ngram")
    engine._compiling = lambda: True   # Dynamo's tracing holds the GIL: these steps measure nothing
    fitted = len(engine.step_cost.samples)  # (the SLO budgets' fit, from its warm-up)
    engine.generate(repetitive_prompts()[0], GREEDY)
    assert engine.spec.cost.steps == 0 and len(engine.step_cost.samples) == fitted
    engine._compiling = lambda: False
    started = iter(range(10**6))   # a graph compiled inside each step (compile_decode=on)
    engine.runner.one_offs = lambda: next(started)
    engine.generate(repetitive_prompts()[1], GREEDY)
    assert engine.spec.cost.steps == 0 and len(engine.step_cost.samples) == fitted
    del engine.runner.one_offs
    engine.generate(repetitive_prompts()[2], GREEDY)
    assert engine.spec.cost.steps > 0 and len(engine.step_cost.samples) > fitted
    finish_clean(engine)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_invariance_with_speculation(folder, spec_reference, case):  # noqa: F811
    engine = force_drafts(make(folder, speculative="ngram", **CASES[case]))
    outs = engine.generate(repetitive_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == spec_reference
    stats = engine.stats()
    assert stats["spec_accepted"] > 0 and stats["spec_proposed"] > stats["spec_accepted"]
    finish_clean(engine)


def test_greedy_invariance_with_speculation_under_kv_pressure(folder, spec_reference):  # noqa: F811
    need = sum(len(p) + GREEDY.max_new_tokens for p in repetitive_prompts())
    engine = force_drafts(make(folder, speculative="ngram", kv_pool_tokens=need // 3,
                               chunked_prefill_size=32, kv_reserve_ratio=0.0))
    outs = engine.generate(repetitive_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == spec_reference
    stats = engine.stats()
    assert stats["retractions"] > 0 and stats["spec_accepted"] > 0
    finish_clean(engine)


def test_stops_logprobs_and_lengths_behave_as_without_speculation(folder):  # noqa: F811
    prompts = repetitive_prompts()[:6]
    off = make(folder)
    ref = off.generate(prompts, GREEDY)
    stop_ids = [r.token_ids[9] for r in ref]  # each stops at its 10th token (or sooner)
    params = [GREEDY.replace(max_new_tokens=17, logprobs=True, top_logprobs=2, stop_token_ids=[t])
              for t in stop_ids]
    want = off.generate(prompts, params)
    on = force_drafts(make(folder, speculative="ngram"))
    got = on.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [[t for t, _ in pos] for pos in a.top_logprobs] == [[t for t, _ in pos] for pos in b.top_logprobs]
        assert len(a.meta["itl"]) == len(a.token_ids) - 1
    assert on.stats()["spec_accepted"] > 0
    finish_clean(on)
    finish_clean(off)


def test_aborts_between_speculative_steps_keep_the_pool_whole(folder):  # noqa: F811
    engine = force_drafts(make(folder, speculative="ngram"))
    reqs = [r for p in repetitive_prompts() for r in engine.submit(p, GREEDY.replace(max_new_tokens=60))]
    for step in range(40):
        engine.step()
        engine.check_pool_whole()
        if step in (6, 12, 20):
            for req in reqs[step % 5::4]:
                engine.abort(req.rid)
    engine.run_until_done(reqs)
    assert engine.stats()["spec_accepted"] > 0
    assert any(r.finish_reason == "abort" for r in reqs)
    finish_clean(engine)


def test_seeded_sampling_is_identical_with_speculation(folder):  # noqa: F811
    prompts = repetitive_prompts()
    params = [SamplingParams(temperature=0.7, top_k=20, seed=100 + i, max_new_tokens=24, ignore_eos=True,
                             repetition_penalty=1.1) for i in range(len(prompts))]
    off = make(folder).generate(prompts, params)
    engine = force_drafts(make(folder, speculative="ngram"))
    on = engine.generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert engine.stats()["spec_accepted"] > 0
    finish_clean(engine)


def test_unseeded_sampling_keeps_the_target_distribution(folder):  # noqa: F811
    """The tokens at speculated positions: their distribution, spec on vs off, over many samples,
    must not differ (chi-square test of homogeneity, p >= P_VALUE)."""
    prompt = repetitive_prompts()[4]
    params = SamplingParams(temperature=0.8, max_new_tokens=4, ignore_eos=True)

    def sample(engine, rounds=10, batch=60):
        out = []
        for _ in range(rounds):
            out += [o.token_ids for o in engine.generate([prompt] * batch, params)]
        return out

    on_engine = force_drafts(make(folder, speculative="ngram", random_seed=1, max_running_requests=64))
    on = sample(on_engine)
    off = sample(make(folder, random_seed=2, max_running_requests=64))
    stats = on_engine.stats()
    assert stats["spec_proposed"] > 500 and 0.1 < stats["spec_acceptance_rate"] < 0.95
    for position in (1, 2, 3):
        tokens = sorted({t[position] for t in on + off})
        table = np.array([[sum(t[position] == tok for t in side) for tok in tokens] for side in (on, off)])
        common = table[:, table.sum(0) >= 10]
        rare = table[:, table.sum(0) < 10].sum(1, keepdims=True)
        table = np.hstack([common, rare]) if rare.sum() else common
        assert chi2_contingency(table).pvalue >= P_VALUE, (position, table)
    finish_clean(on_engine)


def test_plain_steps_a_compiled_graph_ran_feed_the_cost_fit(folder):  # noqa: F811
    # every plain decode step runs compiled (as under compile_decode="on", or once auto kept the
    # graphs): the fit must still learn, or no verify step is ever weighed and drafts never come
    engine = make(folder, speculative="ngram")
    forward = engine.runner.forward

    def as_if_compiled(fb):
        logits = forward(fb)
        engine.runner.ran_compiled = fb.num_tokens == fb.batch_size  # a plain decode forward
        return logits
    engine.runner.forward = as_if_compiled
    before = engine.spec.counters.verified
    for prompt in repetitive_prompts()[:4]:
        engine.generate(prompt, GREEDY)
    assert engine.spec.counters.verified > before         # drafts were weighed and verified
    assert engine.spec.cost.xtx[4, 4] > 0                 # compiled steps were fitted, as such
    finish_clean(engine)
