"""Engine invariance: greedy outputs do not depend on batching, caching, chunking, policy or
KV pressure. Runs on a tiny random llama in float32."""
import pytest
import torch

import stemma
from stemma import SamplingParams
from tests.tiny_models import build_tiny

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("llama_engine")))


def make(folder, **kw):
    cfg = dict(dtype="float32", kv_pool_tokens=2048, max_running_requests=16, attention_backend="torch",
               speculative="none")  # the unspeculated reference; test_speculative turns it on
    cfg.update(kw)
    return stemma.Engine(folder, **cfg)


def prompts(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 70, 12, 41, 5, 90, 27, 8, 55, 16, 33, 64, 9, 21, 47, 2][:n]
    shared = torch.randint(3, 96, (20,), generator=g).tolist()
    out = []
    for i, n_tok in enumerate(lengths):
        own = torch.randint(3, 96, (n_tok,), generator=g).tolist()
        out.append(shared + own if i % 3 == 0 else own)  # some share a prefix
    return out


def finish_clean(engine):
    engine.check_pool_whole()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["queue"] == 0
    assert engine.flush_cache()
    assert engine.stats()["pool_free"] == engine.stats()["pool_total"]


@pytest.fixture(scope="module")
def reference(folder):
    engine = make(folder)
    ref = [engine.generate(p, GREEDY).token_ids for p in prompts()]
    finish_clean(engine)
    assert len({tuple(r) for r in ref}) > 8  # the tiny model really varies its outputs
    assert all(len(set(r)) > 3 for r in ref)
    return ref


CASES = {
    "batched": {},
    "radix_off": {"enable_radix_cache": False},
    "chunked_32": {"chunked_prefill_size": 32},
    "policy_fcfs": {"schedule_policy": "fcfs"},
    "policy_dfs_weight": {"schedule_policy": "dfs-weight"},
    "policy_sjf": {"schedule_policy": "sjf"},
    "dynamic": {"batching": "dynamic", "dynamic_wait_ms": 5},
    "static": {"batching": "static", "max_running_requests": 5},
    "small_prefill_budget": {"max_prefill_tokens": 40, "chunked_prefill_size": None},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_invariance(folder, reference, case):
    engine = make(folder, **CASES[case])
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    finish_clean(engine)


def test_invariance_under_kv_pressure(folder, reference):
    need = sum(len(p) + GREEDY.max_new_tokens for p in prompts())
    engine = make(folder, kv_pool_tokens=need // 4, chunked_prefill_size=32)
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.stats()["retractions"] > 0
    assert sum(o.meta["retractions"] for o in outs) == engine.stats()["retractions"]
    finish_clean(engine)


def test_prompt_logprobs_of_a_retracted_request_are_those_it_gets_alone(folder):
    """Retracted while decoding, a request's tokens hold its outputs: its prompt's last position
    scored the first output token as one more prompt logprob. Once whole they are kept, so a
    readmission reuses its cached prefix instead of scoring the prompt again."""
    wanted = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, logprob_start=0)
    prompt, other = prompts(16)[9], prompts(16)[3]
    alone = make(folder).generate(prompt, wanted)
    engine = make(folder, kv_pool_tokens=96, chunked_prefill_size=16, kv_reserve_ratio=0.0)
    (b,) = engine.submit(other, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    (a,) = engine.submit(prompt, wanted)
    while not (a.finished and b.finished):
        engine.step()
    out = engine.output(a)
    assert out.meta["retractions"] > 0 and out.token_ids == alone.token_ids
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-5)
    assert out.meta["retractions"] <= 4  # 13 when each readmission scored the prompt again
    finish_clean(engine)


def test_seeded_sample_same_alone_and_batched(folder):
    engine = make(folder)
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, seed=1234, ignore_eos=True)
    target = prompts()[3]
    alone = engine.generate(target, sp).token_ids
    others = [p for i, p in enumerate(prompts()) if i != 3][:15]
    batch = others[:7] + [target] + others[7:]
    params = [SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)] * 16
    params[7] = sp
    outs = engine.generate(batch, params)
    assert outs[7].token_ids == alone
    unseeded = [o.token_ids for i, o in enumerate(outs) if i != 7]
    assert len({tuple(u) for u in unseeded}) > 1
    finish_clean(engine)


def test_unseeded_sampling_leaves_the_global_rng_alone(folder):
    """Unseeded rows draw from the engine's own generator: a torch.compile anywhere in the
    process restores torch's global RNG state when it ends, which would replay the noise of
    every step sampled during it. With random_seed, two engines draw alike."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    engine = make(folder)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    engine.generate(prompts()[:4], [sp] * 4)
    assert torch.equal(torch.get_rng_state(), state)
    seeded = [make(folder, random_seed=7).generate(prompts()[1], sp).token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]
    finish_clean(engine)


def test_shared_prefix_is_served_from_cache(folder):
    engine = make(folder, kv_pool_tokens=8192, max_running_requests=64)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 96, (200,), generator=g).tolist() * 5   # 1,000 tokens
    batch = [prefix + torch.randint(3, 96, (8,), generator=g).tolist() for _ in range(64)]
    outs = engine.generate(batch, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    cached = sum(min(o.meta["cached_tokens"], len(prefix)) for o in outs)
    assert cached >= 0.9 * 64 * len(prefix)
    stats = engine.stats()
    assert stats["cached_tokens"] >= 0.9 * 64 * len(prefix)
    finish_clean(engine)


def test_n_samples_share_prompt(folder):
    engine = make(folder)
    prompt = prompts()[5]
    outs = engine.generate(prompt, SamplingParams(temperature=1.0, n=4, seed=7, max_new_tokens=8, ignore_eos=True))
    assert len(outs) == 4
    assert sum(o.meta["cached_tokens"] for o in outs) >= 3 * (len(prompt) - 1)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    finish_clean(engine)


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_reference(request, folder):
    """Each prompt alone, greedy, with weight-only quantized matrices (fp32 activations)."""
    engine = make(folder, quantization=request.param)
    assert set(engine.loaded.stores.values()) >= {request.param}
    ref = [engine.generate(p, GREEDY).token_ids for p in prompts()]
    finish_clean(engine)
    return request.param, ref


@pytest.mark.parametrize("case", ["batched", "radix_off", "chunked_32", "policy_sjf", "kv_pressure"])
def test_greedy_invariance_quantized(folder, quantized_reference, case):
    quantization, ref = quantized_reference
    options = CASES.get(case, {})
    if case == "kv_pressure":
        need = sum(len(p) + GREEDY.max_new_tokens for p in prompts())
        options = {"kv_pool_tokens": need // 4, "chunked_prefill_size": 32}
    engine = make(folder, quantization=quantization, **options)
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == ref
    finish_clean(engine)
