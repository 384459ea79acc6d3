"""Speculative decoding with a draft model (`speculative="draft:<path>"`).

The target is test_engine's tiny random llama; the drafts come from the same model cut to its
first two layers (a smaller model with the same vocabulary: drafts partly accepted), from another
random llama (drafts nearly always rejected), and from the target itself (every draft accepted,
in fp32). Greedy and seeded outputs must equal speculation off in every engine setting, and both
KV pools, the target's and the draft's, must be whole after every run (and every step, where the
test steps). Drafts are forced to their longest (`force_drafts`), as in test_speculative.
"""
import pytest
import torch

from stemma import SamplingParams
from stemma.engine.request import Request
from stemma.engine_config import EngineConfig
from stemma.executor.runner import RunnerConfig
from stemma.loader.model import load_model
from stemma.speculative.draft_model import DraftModelDrafter, common_prefix
from stemma.speculative.speculation import make_speculation
from tests.test_engine import CASES, GREEDY, finish_clean, folder, make, prompts, reference  # noqa: F401
from tests.test_speculative import force_drafts
from tests.tiny_models import build_tiny, tiny_config


def build_truncated(target, out, layers=2):
    """The target's first `layers` layers, embedding, final norm and head: a smaller draft model."""
    from transformers import AutoModelForCausalLM
    big = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    config = type(big.config).from_dict({**big.config.to_dict(), "num_hidden_layers": layers})
    small = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    keep = small.state_dict()
    small.load_state_dict({k: v for k, v in big.state_dict().items() if k in keep})
    small.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def draft_folder(folder, tmp_path_factory):  # noqa: F811
    return build_truncated(folder, tmp_path_factory.mktemp("llama_draft"))


@pytest.fixture(scope="module")
def other_folder(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("llama_other"), seed=1))


def make_draft(target, draft, **kw):
    return force_drafts(make(target, speculative=f"draft:{draft}", **kw))


def drafter_of(engine) -> DraftModelDrafter:
    return engine.spec.drafter


def check_both(engine):
    engine.check_pool_whole()
    drafter_of(engine).check_pool_whole()


def finish_both(engine):
    """Both pools whole, and every draft row and slot given back once all requests finished."""
    drafter = drafter_of(engine)
    drafter.check_pool_whole()
    assert drafter.rows == {}
    assert drafter.allocator.available == drafter.allocator.total
    assert drafter.table.available == drafter.table.max_reqs
    finish_clean(engine)


def run_checked(engine, reqs):
    """Runs reqs to the end, checking both pools after every step."""
    while not all(r.finished for r in reqs):
        if not engine.step():
            engine.wait_for_work()
        check_both(engine)


def small_drafter(draft, pool, rows, chunk=2048):
    return DraftModelDrafter(load_model(draft, "float32"), RunnerConfig(
        kv_pool_tokens=pool, max_running_requests=rows, attention_backend="torch"), 96, chunk)


@pytest.fixture(scope="module")
def draft_greedy(draft_folder):
    """The draft model's own greedy continuation of a token list (speculation off)."""
    engine = make(draft_folder)
    return lambda tokens, k: engine.generate(list(tokens), GREEDY.replace(max_new_tokens=k)).token_ids


# ---------------------------------------------------------------- the drafter alone

def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 10) == 4
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4, 5], 10) == 2
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 3) == 3
    assert common_prefix([], [1], 1) == 0 and common_prefix([5], [1], 1) == 0
    for n in range(9):
        a = list(range(8))
        assert common_prefix(a, a[:n] + [99] * 3, 20) == n


@pytest.mark.parametrize("chunk", [2048, 16])
def test_drafts_are_the_draft_model_s_greedy_tokens_through_rejections(draft_folder, draft_greedy, chunk):
    """Batched drafts of requests of different lengths equal the draft model's greedy tokens, step
    after step, as the 'target' accepts some of them and then samples something else (the draft
    KV of rejected drafts must be dropped, and caught up again). chunk=16: long catch-ups run in
    several forwards."""
    drafter = small_drafter(draft_folder, 2048, 8, chunk)
    reqs = [Request(rid=str(i), input_ids=p, params=GREEDY) for i, p in enumerate(prompts()[:6])]
    lengths = [8, 1, 5, 3, 8, 2]
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        before = drafter.forwards
        drafts = drafter.propose(reqs, lengths)
        catch_up = 16 if chunk == 16 and step == 0 else 0  # ceil((261 - 6) / 16) chunk forwards
        assert drafter.forwards - before == max(lengths) + catch_up
        for req, k, (d, source) in zip(reqs, lengths, drafts):
            assert source == "draft" and d == draft_greedy(req.tokens, k)
        drafter.check_pool_whole()
        assert drafter.held() == sum(len(r.tokens) + k - 1 for r, k in zip(reqs, lengths))
        for j, (req, (d, _)) in enumerate(zip(reqs, drafts)):
            a = (j + step) % (len(d) + 1)       # drafts accepted, then a token sampled
            other = int(torch.randint(3, 96, (1,), generator=g))
            req.tokens.extend(d[:a] + [other if a == len(d) or other != d[a] else (other + 1) % 96])
        if step == 2:
            lengths = [2, 8, 1, 8, 4, 6]
    for req in reqs:
        drafter.release(req)
        drafter.check_pool_whole()
    assert drafter.rows == {} and drafter.allocator.available == drafter.allocator.total


def test_a_full_draft_pool_gives_fewer_drafts_idle_rows_first_and_never_fails(draft_folder, draft_greedy):
    drafter = small_drafter(draft_folder, 120, 2)   # 120 slots, 3 rows
    reqs = [Request(rid=str(i), input_ids=p, params=GREEDY) for i, p in enumerate(prompts()[:6])]
    assert [len(r.tokens) for r in reqs] == [23, 70, 12, 61, 5, 90]
    drafts = [d for d, _ in drafter.propose(reqs, [8] * 6)]
    assert [len(d) for d in drafts] == [8, 8, 2, 0, 0, 0]   # 30 + 77 + 13 slots: pool and rows full
    for req, d in zip(reqs, drafts):
        assert d == draft_greedy(req.tokens, len(d))[:len(d)]
    drafter.check_pool_whole()
    # the first three draft nothing now: their draft KV makes room for the others
    drafts = [d for d, _ in drafter.propose(reqs[3:], [8] * 3)]
    assert [len(d) for d in drafts] == [8, 8, 0]               # 68 + 12 slots; 97 do not fit
    assert {s.req.rid for s in drafter.rows.values()} == {"3", "4"}
    drafter.check_pool_whole()
    long = Request(rid="long", input_ids=list(range(3, 96)) * 2, params=GREEDY)  # over the pool
    assert drafter.propose([long], [8]) == [([], "draft")]
    drafter.check_pool_whole()


def test_a_draft_model_with_another_vocabulary_is_refused(folder, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM
    config = tiny_config("llama")
    config.vocab_size = 100
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path))
    engine = make(folder)
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", speculative=f"draft:{tmp_path}")
    cache = engine.cache
    with pytest.raises(ValueError, match="vocabulary"):
        make_speculation(cfg, cache, engine.runner.req_to_slot, engine.runner.max_context,
                         target=engine.runner)
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", speculative=f"draft:{folder}")
    spec = make_speculation(cfg, cache, engine.runner.req_to_slot, engine.runner.max_context, target=engine.runner)
    drafter = spec.drafter
    assert drafter.runner.device == engine.runner.device and drafter.runner.dtype == engine.runner.dtype
    assert drafter.runner.pool is not engine.runner.pool
    assert drafter.allocator.total == engine.runner.pool.allocator.total
    assert drafter.table.max_reqs == engine.runner.req_to_slot.max_reqs


# ---------------------------------------------------------------- the engine

@pytest.mark.parametrize("case", list(CASES))
def test_greedy_invariance_with_a_draft_model(folder, draft_folder, reference, case):  # noqa: F811
    engine = make_draft(folder, draft_folder, **CASES[case])
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = engine.stats()
    assert stats["spec_accepted"] > 0 and stats["spec_proposed"] > stats["spec_accepted"]
    finish_both(engine)


def test_greedy_invariance_when_the_cost_model_chooses(folder, draft_folder, reference):  # noqa: F811
    engine = make(folder, speculative=f"draft:{draft_folder}")
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    finish_both(engine)


def test_a_failing_draft_forward_gives_no_drafts_and_leaks_no_draft_slot(folder, draft_folder, reference,  # noqa: F811
                                                                        monkeypatch):
    engine = make_draft(folder, draft_folder)
    drafter = drafter_of(engine)
    forward, calls = drafter._forward, []

    def failing(*args, **kw):  # every third draft forward fails, mid-way through some drafting
        calls.append(1)
        if len(calls) % 3 == 0:
            raise RuntimeError("the draft forward broke")
        return forward(*args, **kw)
    monkeypatch.setattr(drafter, "_forward", failing)
    reqs = [r for p in prompts() for r in engine.submit(p, GREEDY)]
    run_checked(engine, reqs)
    assert [r.output_ids for r in reqs] == reference
    assert engine.stats()["spec_accepted"] > 0
    finish_both(engine)


def test_greedy_invariance_with_a_draft_model_under_kv_pressure(folder, draft_folder, reference):  # noqa: F811
    need = sum(len(p) + GREEDY.max_new_tokens for p in prompts())
    engine = make_draft(folder, draft_folder, kv_pool_tokens=need // 3, chunked_prefill_size=32,
                        kv_reserve_ratio=0.0)
    reqs = [r for p in prompts() for r in engine.submit(p, GREEDY)]
    run_checked(engine, reqs)
    assert [r.output_ids for r in reqs] == reference
    stats = engine.stats()
    assert stats["retractions"] > 0 and stats["spec_accepted"] > 0
    finish_both(engine)


def test_greedy_invariance_with_a_small_draft_pool(folder, draft_folder, reference):  # noqa: F811
    """A draft pool far smaller than the batch needs: requests draft less, or not at all."""
    engine = make_draft(folder, draft_folder)
    engine.spec.drafter = small_drafter(draft_folder, 200, 4)
    reqs = [r for p in prompts() for r in engine.submit(p, GREEDY)]
    run_checked(engine, reqs)
    assert [r.output_ids for r in reqs] == reference
    assert engine.stats()["spec_accepted"] > 0
    finish_both(engine)


@pytest.mark.parametrize("draft", ["truncated", "other", "itself"])
def test_seeded_sampling_is_identical_with_a_draft_model(folder, draft_folder, other_folder, draft):  # noqa: F811
    """"itself": the target's greedy tokens as drafts of sampled requests, partly accepted (runs
    of several drafts accepted, then a rejection)."""
    ps = prompts()
    params = [SamplingParams(temperature=0.7, top_k=20, seed=100 + i, max_new_tokens=24, ignore_eos=True,
                             repetition_penalty=1.1) for i in range(len(ps))]
    off = make(folder).generate(ps, params)
    engine = make_draft(folder, {"truncated": draft_folder, "other": other_folder, "itself": folder}[draft])
    on = engine.generate(ps, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    stats = engine.stats()
    assert stats["spec_proposed"] > stats["spec_accepted"]
    if draft == "itself":
        assert stats["spec_mean_accepted"] > 1.0 and stats["spec_acceptance_rate"] > 0.1
    finish_both(engine)


def test_aborts_between_draft_model_steps_keep_both_pools_whole(folder, draft_folder):  # noqa: F811
    engine = make_draft(folder, draft_folder)
    reqs = [r for p in prompts() for r in engine.submit(p, GREEDY.replace(max_new_tokens=60))]
    for step in range(40):
        engine.step()
        check_both(engine)
        if step in (6, 12, 20):
            for req in reqs[step % 5::4]:
                engine.abort(req.rid)
            check_both(engine)
    run_checked(engine, reqs)
    assert engine.stats()["spec_accepted"] > 0
    assert any(r.finish_reason == "abort" for r in reqs)
    finish_both(engine)


def test_the_target_as_its_own_draft_has_every_draft_accepted(folder, reference):  # noqa: F811
    engine = make_draft(folder, folder)
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = engine.stats()
    assert stats["spec_proposed"] > 200
    assert stats["spec_acceptance_rate"] >= 0.99
    assert stats["spec_mean_accepted"] > 4
    finish_both(engine)
