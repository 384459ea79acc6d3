"""SamplingParams validation and codec; the sampler's filters, penalties, seeds and logprobs."""
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field, fields

import pytest
import torch
from hypothesis import given, settings, strategies as st

from stemma.sampling.sampler import Sampler, apply_penalties
from stemma.sampling.batch import SamplingBatch
from stemma.sampling.seeded_noise import _mul32, mix32, seeded_uniform
from stemma.sampling_params import SamplingParams

# ---------------------------------------------------------------- SamplingParams

BAD_VALUES = [
    ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("min_new_tokens", -1), ("min_new_tokens", 129),  # > max_new_tokens (128)
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", None),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5), ("frequency_penalty", -3),
    ("presence_penalty", 2.1), ("presence_penalty", -2.1),
    ("stop", 5), ("stop", [""]), ("stop", ["a", 1]),
    ("stop_token_ids", [-1]), ("stop_token_ids", 3), ("stop_token_ids", ["a"]),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {3: 101}),
    ("logit_bias", 5), ("logit_bias", [(1,)]),
    ("ignore_eos", 1),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0),
    ("n", 0), ("n", None),
    ("logprobs", 1),
    ("top_logprobs", -1),
    ("logprob_start", -1), ("logprob_start", 0.5),
    ("skip_special_tokens", None),
    ("include_stop_str_in_output", "yes"),
    ("regex", ""), ("regex", 5),
    ("json_schema", "{not json"), ("json_schema", "[1]"), ("json_schema", 3),
    ("json_schema", {"x": float("nan")}),
    ("grammar", ""), ("grammar", b"start: x"),
    ("priority", 1.5), ("priority", True), ("priority", -2**31 - 1),
    ("ttft_slo_ms", 0), ("ttft_slo_ms", math.inf), ("ttft_slo_ms", "5"),
    ("itl_slo_ms", -1.0), ("itl_slo_ms", math.nan),
]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_bad_value_is_a_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**{name: value})


def test_every_field_has_a_bad_value_case():
    assert {f.name for f in fields(SamplingParams)} == {name for name, _ in BAD_VALUES}


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.stop, p.seed) == (128, 1.0, -1, (), None)
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy
    hash(SamplingParams(stop=["x"]))  # frozen and normalised to tuples: usable as a key


def test_to_dict_is_plain_and_round_trips():
    p = SamplingParams(max_new_tokens=7, temperature=0.3, stop=["x", "y"], stop_token_ids=[5],
                       seed=42, top_logprobs=3, logprob_start=2, repetition_penalty=1.2)
    d = p.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["stop"] == ["x", "y"] and d["seed"] == 42
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict({}) == SamplingParams()


@settings(max_examples=60, deadline=None)
@given(st.builds(
    SamplingParams,
    max_new_tokens=st.integers(0, 4096), temperature=st.floats(0, 5),
    top_p=st.floats(0.01, 1), top_k=st.sampled_from([-1, 1, 50]), min_p=st.floats(0, 1),
    frequency_penalty=st.floats(-2, 2), stop=st.lists(st.text(min_size=1), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 10**6), max_size=3).map(tuple),
    seed=st.none() | st.integers(0, 2**63 - 1), logprob_start=st.none() | st.integers(0, 99)))
def test_from_dict_inverts_to_dict(p):
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_unknown_fields_are_rejected_by_name():
    with pytest.raises(ValueError, match="max_tokens.*temprature"):
        SamplingParams.from_dict({"temprature": 1.0, "max_tokens": 5, "n": 1})
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams().replace(max_tokens=3)


def test_replace_changes_and_revalidates():
    p = SamplingParams(temperature=0.5, stop="a")
    q = p.replace(seed=3, stop=["b"])
    assert (q.seed, q.stop, q.temperature, p.seed) == (3, ("b",), 0.5, None)
    with pytest.raises(ValueError, match="^temperature"):
        p.replace(temperature=-1)


def test_import_does_not_load_torch():
    code = ("import sys, stemma; stemma.SamplingParams(seed=1); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- sampler helpers

@dataclass
class Req:
    params: SamplingParams
    input_ids: list = field(default_factory=list)
    output_ids: list = field(default_factory=list)


def run(logits, reqs, sampler=None, **build_kwargs):
    batch = SamplingBatch.build(reqs, logits.shape[1], **build_kwargs)
    return (sampler or Sampler(torch.Generator().manual_seed(0))).sample(logits, batch)


def draw_many(row_logits, params, n, seeded=True):
    """Token counts of n independent draws from one logits row (n seeded rows, or n unseeded)."""
    reqs = [Req(params.replace(seed=i) if seeded else params) for i in range(n)]
    tokens = run(row_logits.expand(n, -1).contiguous(), reqs).token_ids
    return torch.bincount(tokens, minlength=row_logits.shape[-1]).double()


def chi_square(counts, probs):
    expected = counts.sum() * probs.double()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def probs_logits(probs, perm):
    """Logits whose softmax puts probs[i] on token perm[i] (so sorting has work to do)."""
    logits = torch.full((10,), -30.0)
    logits[perm] = torch.tensor(probs).log()
    return logits[None, :]


# ---------------------------------------------------------------- greedy, temperature, filters

def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    greedy = run(logits, [Req(SamplingParams(temperature=0))] * 8)
    assert torch.equal(greedy.token_ids, logits.argmax(-1))
    top1 = run(logits, [Req(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(8)])
    assert torch.equal(top1.token_ids, greedy.token_ids)


@pytest.mark.parametrize("seeded", [True, False])
def test_draw_frequencies_match_softmax_at_temperature(seeded):
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 1.4]])
    counts = draw_many(logits, SamplingParams(temperature=2.0), 6000, seeded)
    assert chi_square(counts, torch.softmax(logits[0] / 2.0, -1)) < 40   # df 7: p < 1e-6
    assert chi_square(counts, torch.softmax(logits[0], -1)) > 200        # temperature mattered


def test_tiny_temperature_is_almost_greedy():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(2))
    out = run(logits, [Req(SamplingParams(temperature=1e-4, seed=i)) for i in range(16)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_a_temperature_that_would_overflow_the_logits_is_greedy():
    # logits / 1e-40 are all -inf where every logit is negative: argmax would then be token 0
    logits = -1.0 - torch.rand(4, 50, generator=torch.Generator().manual_seed(3))
    logits[:, 0] = -3.0  # never the argmax
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((1e-40, 1e-30, 9e-6, 1e-45))]
    assert all(p.is_greedy for p in params) and not SamplingParams(temperature=1e-5).is_greedy
    out = run(logits, [Req(p) for p in params])
    assert torch.equal(out.token_ids, logits.argmax(-1)) and not torch.any(out.token_ids == 0)


PROBS = [0.4, 0.3, 0.15, 0.1, 0.05]
PERM = [6, 2, 9, 0, 4]  # token ids carrying PROBS; the other 5 of the 10 have ~0 probability


@pytest.mark.parametrize("options,kept", [
    ({"top_k": 2}, [0.4, 0.3]),
    ({"top_p": 0.75}, [0.4, 0.3, 0.15]),
    ({"min_p": 0.3}, [0.4, 0.3, 0.15]),                 # floor 0.3 * 0.4 = 0.12
    ({"top_k": 3, "top_p": 0.6}, [0.4, 0.3]),           # top_p on top_k-renormalised mass
    ({"top_p": 0.9, "min_p": 0.5}, [0.4, 0.3]),
    # vLLM's order: min_p first (floor 0.3 * 0.4 = 0.12 keeps 0.4, 0.3, 0.15: mass 0.85), then
    # top_p over what it left (0.7 / 0.85 = 0.82 before 0.15 >= 0.8: it goes); over all of the
    # mass (min_p last), 0.7 before 0.15 kept it
    ({"top_p": 0.8, "min_p": 0.3}, [0.4, 0.3]),
    ({}, PROBS),
])
@pytest.mark.parametrize("seeded", [True, False])
def test_filtered_tokens_are_never_drawn(options, kept, seeded):
    logits = probs_logits(PROBS, PERM)
    counts = draw_many(logits, SamplingParams(**options), 3000, seeded)
    expected = torch.zeros(10)
    expected[PERM[:len(kept)]] = torch.tensor(kept) / sum(kept)
    if kept is PROBS:  # unfiltered: the ~0 tokens keep their ~1e-13 mass
        expected = torch.softmax(logits[0], -1)
    assert set(counts.nonzero().flatten().tolist()) == set(PERM[:len(kept)])
    assert chi_square(counts, expected) < 40


# ---------------------------------------------------------------- penalties and bans

def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    penalized = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    reqs = [Req(SamplingParams(), [0, 1], [2, 2, 1]), Req(penalized, [0, 1], [2, 2, 1])]
    scores = apply_penalties(logits, SamplingBatch.build(reqs, 4))
    # token 0: in prompt, 2 > 0 -> 2/2 = 1;            not in output
    # token 1: in prompt, -1 -> -1*2 = -2;             once in output: -2 - 0.5 - 0.25
    # token 2: in output, 0.5 -> 0.25;                 twice in output: 0.25 - 1.0 - 0.25
    # token 3: unseen
    assert torch.equal(scores[0], logits[0])
    assert torch.allclose(scores[1], torch.tensor([1.0, -2.75, -1.0, 3.0]))
    assert torch.equal(logits[1], torch.tensor([2.0, -1.0, 0.5, 3.0]))  # input untouched


def test_greedy_picks_the_penalized_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0, presence_penalty=0.5)
    assert run(logits, [Req(params, [], [])]).token_ids.item() == 0
    assert run(logits, [Req(params, [], [0])]).token_ids.item() == 1


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])  # 3 = eos is the argmax, then 2
    params = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[2])
    pick = lambda req: run(logits, [req], eos_token_ids=[3]).token_ids.item()  # noqa: E731
    assert pick(Req(params, [0], [1])) == 1
    assert pick(Req(params, [0], [1, 1])) == 3
    assert pick(Req(params.replace(ignore_eos=True), [0], [1])) == 3
    assert pick(Req(params.replace(min_new_tokens=0), [0], [])) == 3


def test_logit_bias_is_added_to_the_raw_logits_of_its_row_only():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    biased = SamplingParams(temperature=0, logit_bias={1: 1.5, 2: -100})
    reqs = [Req(SamplingParams(temperature=0)), Req(biased)]
    scores = apply_penalties(logits, SamplingBatch.build(reqs, 3))
    assert torch.equal(scores[0], logits[0])
    assert torch.allclose(scores[1], torch.tensor([3.0, 3.5, -100.0]))
    assert run(logits, reqs).token_ids.tolist() == [0, 1]
    assert biased.logit_bias == ((1, 1.5), (2, -100.0))
    assert SamplingParams.from_dict(biased.to_dict()) == biased
    with pytest.raises(ValueError, match="logit_bias token ids"):
        SamplingBatch.build([Req(SamplingParams(logit_bias={7: 1}))], 3)


def test_banned_ids_are_never_drawn():
    logits = torch.zeros(2, 6)
    logits[:, 4] = 5.0
    reqs = [Req(SamplingParams(seed=i)) for i in range(2)]
    for _ in range(20):
        out = run(logits, reqs, sampler=Sampler(), banned_ids=[[4, 0, 1], [4]])
        assert out.token_ids[0].item() in (2, 3, 5) and out.token_ids[1].item() != 4
        reqs = [Req(r.params, [], r.output_ids + [0]) for r in reqs]


@pytest.mark.parametrize("penalty", [1e-40, 1e-30, 1e39, 3e38])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-5])
def test_an_extreme_repetition_penalty_keeps_the_bans(penalty, temperature):
    # every allowed token (0 and 5 are banned) has been seen: times 1e39 the negative ones
    # overflow to -inf, tying with the banned tokens, and argmax then drew token 0, which is
    # banned; divided by 1e-40 a positive one overflows to +inf, and a softmax over it gives NaN
    logits = torch.tensor([[4.0, -1.0, -2.0, -3.0, -4.0, 5.0], [4.0, 1.0, 2.0, -3.0, -4.0, 5.0]])
    seen = [1, 2, 3, 4]
    reqs = [Req(SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, seed=i), seen, [])
            for i in range(2)]
    banned = [[0, 5], [0, 5]]
    for _ in range(10):
        out = run(logits, reqs, sampler=Sampler(), banned_ids=banned)
        assert set(out.token_ids.tolist()) <= {1, 2, 3, 4}, out.token_ids
    scores = apply_penalties(logits, SamplingBatch.build(reqs, 6, banned_ids=banned))
    assert torch.isfinite(scores[:, 1:5]).all()
    if penalty > 1:   # the order of what is left is kept as far as float32 can hold it
        assert scores[1, 2] >= scores[1, 1] > scores[1, 3] >= scores[1, 4]


@pytest.mark.parametrize("penalty", [1e-46, 1e-40, 1e38, 1e39])
def test_an_extreme_repetition_penalty_keeps_the_constraint_mask(penalty):
    """A constraint masks logits to -inf before the penalties: times a penalty that underflows to
    0 they were NaN (argmax took them), and clamped to -1e30 they tied with seen tokens pushed
    there; the masked stay -inf."""
    masked = torch.tensor([[float("-inf"), -1.0, -2.0, float("-inf"), 3.0, float("-inf")]])
    req = Req(SamplingParams(temperature=0, repetition_penalty=penalty), [0, 1, 2, 3, 4, 5], [])
    scores = apply_penalties(masked, SamplingBatch.build([req], 6))
    assert scores[0, [0, 3, 5]].eq(float("-inf")).all() and torch.isfinite(scores[0, [1, 2, 4]]).all()
    for temperature in (0.0, 1.0):
        reqs = [Req(SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=i), [1, 2, 4], [])
                for i in range(4)]
        for _ in range(5):
            assert set(run(masked.expand(4, 6).clone(), reqs).token_ids.tolist()) <= {1, 2, 4}


@pytest.mark.parametrize("temperature", [3e38, 1e39, 1e300])
def test_a_temperature_past_float32_keeps_the_bans(temperature):
    """1e39 became inf in float32: -inf / inf is NaN, and sampling drew the banned tokens."""
    logits = torch.tensor([[4.0, -1.0, -2.0, -3.0, -4.0, 5.0]]).expand(4, 6).clone()
    reqs = [Req(SamplingParams(temperature=temperature, seed=i), [], []) for i in range(4)]
    for _ in range(10):
        out = run(logits, reqs, sampler=Sampler(), banned_ids=[[0, 5]] * 4)
        assert set(out.token_ids.tolist()) <= {1, 2, 3, 4}, out.token_ids


def test_batch_rejects_bad_inputs():
    with pytest.raises(ValueError, match="outside"):
        SamplingBatch.build([Req(SamplingParams(repetition_penalty=1.1), [7])], 5)
    with pytest.raises(ValueError, match="banned"):
        SamplingBatch.build([Req(SamplingParams())], 5, banned_ids=[[5]])
    with pytest.raises(ValueError, match="banned_ids"):
        SamplingBatch.build([Req(SamplingParams())], 5, banned_ids=[[1], [2]])
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 5), SamplingBatch.build([Req(SamplingParams())], 5))


# ---------------------------------------------------------------- seeds

def random_neighbor(i, gen):
    kind = i % 4
    params = [SamplingParams(temperature=0), SamplingParams(seed=1000 + i, top_p=0.8),
              SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(repetition_penalty=1.3, min_p=0.1, top_logprobs=2)][kind]
    out = torch.randint(0, 64, (i,), generator=gen).tolist()
    return Req(params, [1, 2, 3], out)


def test_seeded_row_is_the_same_alone_and_anywhere_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=40, min_p=0.01,
                            repetition_penalty=1.1)
    row = torch.randn(1, 64, generator=gen) * 2
    for step in range(10):
        req = Req(target, [5, 6], list(range(step)))
        alone = run(row, [req], sampler=Sampler()).token_ids.item()
        for position in (0, 5, 15):
            reqs = [random_neighbor(i + step, gen) for i in range(16)]
            reqs[position] = req
            logits = torch.randn(16, 64, generator=gen) * 2
            logits[position] = row[0]
            out = run(logits, reqs, sampler=Sampler(torch.Generator().manual_seed(step)))
            assert out.token_ids[position].item() == alone, (step, position)


def test_different_seeds_and_steps_draw_differently():
    flat = torch.zeros(1, 1000)
    by_seed = [run(flat, [Req(SamplingParams(seed=s))]).token_ids.item() for s in range(16)]
    by_step = [run(flat, [Req(SamplingParams(seed=7), [], [0] * k)]).token_ids.item()
               for k in range(16)]
    assert len(set(by_seed)) > 12 and len(set(by_step)) > 12
    again = [run(flat, [Req(SamplingParams(seed=s))]).token_ids.item() for s in range(16)]
    assert again == by_seed


def test_hash_multiply_is_exact_mod_2_32():
    xs = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x80000000, 123456789, 0xDEADBEEF]
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        got = _mul32(torch.tensor(xs, dtype=torch.int64), c).tolist()
        assert got == [(x * c) % 2**32 for x in xs]


def test_mix32_matches_exact_integer_reference():
    def reference(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x846CA68B) % 2**32
        return x ^ (x >> 16)
    xs = [0, 1, 2, 0xFFFFFFFF, 0x9E3779B9, 4242424242]
    assert mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == [reference(x) for x in xs]


def test_seeded_uniform_is_open_unit_interval_and_even():
    u = seeded_uniform(torch.tensor([0, 1, 2**63 - 1]), torch.tensor([0, 5, 2**31]), 20000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_raw_model_logprobs_of_the_chosen_token():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4)) * 3
    reqs = [Req(SamplingParams(temperature=0.5, repetition_penalty=1.5, seed=1, logprobs=True), [1, 2], [3]),
            Req(SamplingParams(temperature=0)), Req(SamplingParams(top_k=3)),
            Req(SamplingParams(top_p=0.5, seed=9)), Req(SamplingParams(min_p=0.2)),
            Req(SamplingParams(frequency_penalty=1.0), [], [4, 4])]
    out = run(logits, reqs, banned_ids=[[0]] * 6)
    expected = torch.log_softmax(logits, -1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs, expected)
    assert out.top_logprobs is None


def test_no_logprobs_when_none_asked():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    out = run(logits, [Req(SamplingParams(temperature=0)), Req(SamplingParams(seed=3)), Req(SamplingParams(top_k=2))])
    assert out.logprobs is None and out.top_logprobs is None
    assert out.token_ids[0] == logits[0].argmax()


def test_top_logprobs_are_sorted_and_correct():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    reqs = [Req(SamplingParams(top_logprobs=k)) for k in (0, 3, 5)]
    top = run(logits, reqs).top_logprobs
    assert top.values.shape == top.ids.shape == (3, 5)
    model = torch.log_softmax(logits, -1)
    assert torch.equal(top.values, model.gather(-1, top.ids))
    assert torch.all(top.values[:, :-1] >= top.values[:, 1:])
    assert torch.allclose(top.values, model.sort(-1, descending=True).values[:, :5])


def test_sibling_seeds_are_distinct_stable_and_draw_differently():
    from stemma.sampling.seeded_noise import sibling_seed
    seeds = [sibling_seed(5, i) for i in range(64)] + [sibling_seed(6, i) for i in range(64)]
    assert seeds[0] == 5 and seeds[64] == 6 and len(set(seeds)) == 128
    assert all(0 <= s < 2**63 for s in seeds) and sibling_seed(5, 3) == seeds[3]
    SamplingParams(seed=sibling_seed(2**63 - 1, 7))  # still a valid seed
    flat = torch.zeros(1, 1000)
    tokens = {run(flat, [Req(SamplingParams(seed=s))]).token_ids.item() for s in seeds[:16]}
    assert len(tokens) > 12


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.sampled_from([torch.bfloat16, torch.float32]), st.integers(0, 2**31))
def test_argmax_rows_matches_argmax_in_both_layouts_with_ties(rows, chunks, dtype, seed):
    """Row-major and transposed (column-major) logits; small integer values force ties, also
    across vocabulary chunks."""
    from stemma.sampling.sampler import _ARGMAX_CHUNK, argmax_rows
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (rows, chunks * _ARGMAX_CHUNK), generator=g).to(dtype)
    transposed = logits.t().contiguous().t()
    assert not transposed.is_contiguous() or rows == 1
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(argmax_rows(transposed), logits.argmax(-1))
