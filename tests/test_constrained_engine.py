"""Constrained decoding inside the continuous batch, on a tiny random llama with the ByteLevel test
tokenizer (float32, so batching leaves greedy tokens unchanged). A random model writes noise, so
every output that holds its constraint here holds it because of the mask."""
import json
import math
import re
import threading

import jsonschema
import lark
import pytest

import stemma
from stemma import SamplingParams
from tests.bytelevel_tokenizer import build_tiny_bytelevel

REGEXES = [r"\d{4}-\d{2}-\d{2}", r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)"]
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2}},
     "required": ["name", "age", "pets"]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                   "y": {"type": "boolean"}}, "required": ["x", "y"]},
        "label": {"type": "string", "minLength": 1, "maxLength": 4}},
     "required": ["point", "label"]},
]
GRAMMAR = '''start: expr
expr: term (OP term)~0..2
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
'''
PLAIN = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_bytelevel(tmp_path_factory.mktemp("tiny_bytelevel")))


def make(folder, **kw):
    cfg = dict(dtype="float32", kv_pool_tokens=4096, max_running_requests=48, attention_backend="torch",
               speculative="none")  # step counts below are of plain decoding; speculation is tested on its own
    return stemma.Engine(folder, **{**cfg, **kw})


def constrained_params():
    """(params, check) pairs: regexes, schemas and the grammar, greedy and seeded."""
    out = []
    for i, rx in enumerate(REGEXES):
        for temperature in (0.0, 1.0):
            out.append((SamplingParams(regex=rx, temperature=temperature, seed=i, max_new_tokens=64),
                        ("regex", rx)))
    for i, schema in enumerate(SCHEMAS):
        for seed in range(3):
            out.append((SamplingParams(json_schema=schema, temperature=1.0, seed=seed, max_new_tokens=96),
                        ("schema", schema)))
    for seed in range(3):
        out.append((SamplingParams(grammar=GRAMMAR, temperature=1.0, seed=seed, max_new_tokens=64),
                    ("grammar", GRAMMAR)))
    return out


def assert_holds(text: str, check) -> None:
    kind, rule = check
    if kind == "regex":
        assert re.fullmatch(rule, text), (rule, text)
    elif kind == "schema":
        jsonschema.validate(json.loads(text), rule)
    else:
        lark.Lark(rule).parse(text)


def plain_prompts():
    return [[5 + i, 40 + 3 * i, 77, 100 + i] for i in range(8)]


def test_constrained_and_plain_requests_share_the_batch(folder):
    engine = make(folder)
    alone = [engine.generate(p, PLAIN).token_ids for p in plain_prompts()]
    pairs = constrained_params()
    constrained, plain = [], []
    for i, (params, _) in enumerate(pairs):  # interleaved, so masked rows sit between plain ones
        constrained += engine.submit([9 + i, 30, 31], params)
        if i < 8:
            plain += engine.submit(plain_prompts()[i], PLAIN)
    engine.run_until_done(constrained + plain)
    constrained = [engine.output(r) for r in constrained]
    plain = [engine.output(r) for r in plain]
    for out, (_, check) in zip(constrained, pairs):
        assert out.finish_reason == "stop", (out.text, check)
        assert_holds(out.text, check)
    assert [o.token_ids for o in plain] == alone  # the masks never touch the plain rows
    assert len({o.text for o in constrained}) > len(pairs) // 2  # seeded samples differ
    assert engine.scheduler.constrainer.stats.jumps > 0
    engine.check_pool_whole()


@pytest.mark.parametrize("jump", [True, False])
def test_constrained_requests_speculate_with_the_outputs_of_plain_decoding(folder, jump):
    """Drafts cut where the constraint forbids them, rows masked along the drafts' path: greedy
    and seeded outputs equal those without speculation. The second pass drafts from the radix
    tree's cached continuations (the first pass's outputs), so drafts are accepted."""
    pairs = constrained_params()
    params = [p.replace(temperature=0.0) if i % 2 else p for i, (p, _) in enumerate(pairs)]
    prompts = [[9 + i, 30, 31] for i in range(len(pairs))]
    want = make(folder, enable_jump_forward=jump).generate(prompts, params)
    on = make(folder, speculative="ngram", enable_jump_forward=jump)
    on.spec.choose = lambda decodes, cands, *_: [most for _, most in cands]  # every proposal verified
    for _ in range(2):
        got = on.generate(prompts, params)
        for a, b, (_, check) in zip(got, want, pairs):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), check
            assert_holds(a.text, check)
        on.check_pool_whole()
    stats = on.stats()
    assert stats["spec_proposed"] > 0 and stats["spec_accepted"] > 0


def test_forced_text_is_a_free_draft_where_jump_forward_does_not_run(folder):
    """Requests asking for logprobs are never jump-forwarded; with speculation the text their
    schema forces is drafted and verified, with the same tokens and logprobs as without."""
    schema = SCHEMAS[0]
    params = [SamplingParams(json_schema=schema, temperature=t, seed=s, max_new_tokens=96, logprobs=True)
              for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    prompts = [[3, 4, 5], [6, 7], [8]]
    want = make(folder).generate(prompts, params)
    on = make(folder, speculative="ngram")
    on.spec.choose = lambda decodes, cands, *_: [most for _, most in cands]
    got = on.generate(prompts, params)
    for a, b in zip(got, want):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        jsonschema.validate(json.loads(a.text), schema)
    forced = on.spec.sources["forced"]
    assert forced.hits > 10          # forced tokens were drafted and accepted
    on.check_pool_whole()


def test_jump_forward_saves_steps_and_keeps_outputs_valid(folder):
    schema = {"type": "object", "properties": {
        "first_name": {"type": "string", "maxLength": 3},
        "favourite_colour": {"enum": ["red", "green"]},
        "is_registered": {"type": "boolean"}},
        "required": ["first_name", "favourite_colour", "is_registered"]}
    params = [SamplingParams(json_schema=schema, temperature=1.0, seed=s, max_new_tokens=96) for s in range(4)]
    runs = {}
    for jump in (True, False):
        engine = make(folder, enable_jump_forward=jump)
        outs = engine.generate([[3, 4, 5]] * 4, params)
        for out in outs:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), schema)
        runs[jump] = (engine.stats()["steps"], engine.scheduler.constrainer.stats)
        engine.check_pool_whole()
    (steps_on, stats_on), (steps_off, stats_off) = runs[True], runs[False]
    assert stats_off.jumps == 0 and stats_on.jumps > 0 and stats_on.forced_tokens > 10
    assert steps_on < steps_off


def test_bad_constraints_fail_at_submission_and_the_engine_keeps_serving(folder):
    engine = make(folder)
    bad = [({"regex": "(unclosed"}, "^regex: .*unclosed group"),
           ({"json_schema": {"type": "integer", "multipleOf": 2}}, "^json_schema keyword 'multipleOf'"),
           ({"grammar": "start: nothing"}, '^grammar is invalid: .*unknown name: "nothing"')]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.submit([5, 6], SamplingParams(**fields, n=2))
        assert not engine.scheduler.has_work  # neither of the n=2 requests was queued
    out = engine.generate([5, 6], SamplingParams(regex="(yes|no)", max_new_tokens=8))
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_failed_build_ends_only_its_request(folder, monkeypatch):
    engine = make(folder)
    cache = engine.scheduler.constrainer.indexes
    real_get = cache.get

    def get(regex, vocab):
        if regex == "boom+":
            raise MemoryError("no room for this Index")
        return real_get(regex, vocab)
    monkeypatch.setattr(cache, "get", get)
    doomed = engine.submit([5, 6], SamplingParams(regex="boom+"))
    fine = engine.submit([5, 7], SamplingParams(regex="(yes|no)", max_new_tokens=8))
    plain = engine.submit([5, 8], PLAIN)
    engine.run_until_done(doomed + fine + plain)
    out = engine.output(doomed[0])
    assert out.finish_reason == "error" and "MemoryError: no room" in out.meta["error"]
    assert engine.output(fine[0]).text in ("yes", "no") and len(plain[0].output_ids) == 20
    engine.check_pool_whole()


def test_abort_in_the_grammar_queue(folder, monkeypatch):
    engine = make(folder)
    cache = engine.scheduler.constrainer.indexes
    release, real_get = threading.Event(), cache.get
    monkeypatch.setattr(cache, "get", lambda regex, vocab: release.wait(30) and real_get(regex, vocab))
    (req,) = engine.submit([5, 6], SamplingParams(regex="[a-z]{4}"), rid="slow")
    assert engine.step() == [] and engine.scheduler.has_work  # waits outside the batch
    assert engine.abort("slow") is req and req.finish_reason == "abort"
    release.set()
    assert not engine.scheduler.has_work
    engine.check_pool_whole()


def test_constraints_hold_under_kv_pressure_with_retraction(folder):
    engine = make(folder, kv_pool_tokens=200, kv_reserve_ratio=0.0, chunked_prefill_size=16)
    pairs = [(SamplingParams(json_schema=SCHEMAS[0], temperature=1.0, seed=s, max_new_tokens=96),
              ("schema", SCHEMAS[0])) for s in range(12)]
    outs = engine.generate([[3 + i] * 12 for i in range(12)], [p for p, _ in pairs])
    assert engine.stats()["retractions"] > 0
    for out, (_, check) in zip(outs, pairs):
        assert out.finish_reason == "stop"
        assert_holds(out.text, check)
    engine.check_pool_whole()


def test_logprob_requests_sample_every_token(folder):
    engine = make(folder)
    params = SamplingParams(json_schema=SCHEMAS[1], temperature=1.0, seed=1, max_new_tokens=96,
                            logprobs=True, top_logprobs=2)
    out = engine.generate([3, 4], params)
    jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    assert engine.scheduler.constrainer.stats.jumps == 0
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    assert all(lp <= 0.0 for lp in out.logprobs)


def test_a_near_zero_temperature_keeps_the_constraint_and_finite_logprobs(folder):
    # a temperature of 1e-40 once made every allowed logit -inf, so token 0 (forbidden) was drawn
    # with logprob -inf, and the HTTP reply of it failed to encode as JSON
    engine = make(folder)
    for rx, prompt in (("ab|cd", [10, 11, 12]), ("}\x13", [3, 4, 5]), ("[a-z]{3}", [3, 4, 5])):
        params = SamplingParams(regex=rx, temperature=1e-40, seed=0, max_new_tokens=8,
                                logprobs=True, top_logprobs=5)
        out = engine.generate(prompt, params)
        assert_holds(out.text, ("regex", rx))
        assert all(math.isfinite(lp) for lp in out.logprobs)
        assert all(math.isfinite(v) for top in out.top_logprobs for _, v in top)


def test_n_samples_and_ignore_eos_end_where_the_constraint_does(folder):
    engine = make(folder)
    outs = engine.generate([4, 4], SamplingParams(regex=r"[0-9]{2}-(ab|cd)", n=3, seed=7,
                                                    temperature=1.0, ignore_eos=True, max_new_tokens=50))
    for out in outs:
        assert re.fullmatch(r"[0-9]{2}-(ab|cd)", out.text) and out.finish_reason == "stop"
    engine.check_pool_whole()


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_ignore_eos_and_min_new_tokens_hold_a_complete_constraint_s_end(folder, speculative):
    """Where the constraint is complete but may go on ("a+" after one a), its end is held while
    the request ignores EOS or has fewer than min_new_tokens (it ended there, EOS pushed up by
    logit_bias); where it can only end, it ends (the test above)."""
    engine = make(folder, speculative=speculative)
    eos = engine.tokenizer.eos_token_id
    base = dict(temperature=0, regex="a+", max_new_tokens=8, logit_bias={eos: 50.0})
    assert len(engine.generate("hello", SamplingParams(**base)).token_ids) <= 2  # ends at once
    out = engine.generate("hello", SamplingParams(**base, ignore_eos=True))
    assert out.finish_reason == "length" and re.fullmatch("a+", out.text) and len(out.token_ids) == 8
    out = engine.generate("hello", SamplingParams(**base, min_new_tokens=5))
    assert out.finish_reason == "stop" and re.fullmatch("a+", out.text) and len(out.text) >= 5
    # "(ab)+" after "ab": outlines-core's own Index (0.2.14) kept no byte's way on from there, only
    # the token "ab"'s; the guide took the missing bytes for an end and stopped there
    assert engine.tokenizer.convert_tokens_to_ids("ab") != engine.tokenizer.unk_token_id
    out = engine.generate("hello", SamplingParams(**{**base, "regex": "(ab)+"}, ignore_eos=True))
    assert out.finish_reason == "length" and re.fullmatch("(ab)+", out.text) and len(out.token_ids) == 8
    engine.check_pool_whole()


def test_siblings_share_one_check_of_a_slow_constraint(folder, monkeypatch):
    """The n siblings' constraint is checked once: when its compile outlasts the check window,
    each further check queued behind it, stalling the engine loop n windows (0.25 s each)."""
    engine = make(folder)
    constrainer = engine.scheduler.constrainer
    check, calls = constrainer.check, []
    monkeypatch.setattr(constrainer, "check", lambda params: calls.append(params) or check(params))
    reqs = engine.submit([4, 4], SamplingParams(regex=r"[0-9]{2}", n=4, seed=1, temperature=1.0))
    assert len(reqs) == 4 and len(calls) == 1
    engine.run_until_done(reqs)
    assert all(re.fullmatch(r"[0-9]{2}", engine.output(r).text) for r in reqs)
    engine.check_pool_whole()


def test_a_model_without_tokenizer_refuses_constraints_by_field(tmp_path):
    from tests.tiny_models import build_tiny
    engine = make(str(build_tiny("llama", tmp_path)))
    with pytest.raises(ValueError, match="^regex: constrained decoding needs the model's tokenizer"):
        engine.submit([5, 6], SamplingParams(regex="a+"))
    assert not engine.scheduler.has_work


def test_a_constraint_that_ends_on_the_last_allowed_token_reports_stop(folder):
    engine = make(folder, enable_jump_forward=False)
    out = engine.generate([4, 5], SamplingParams(regex="[#%&]{3}", max_new_tokens=3, temperature=1.0, seed=2))
    assert re.fullmatch("[#%&]{3}", out.text) and len(out.token_ids) == 3
    assert out.finish_reason == "stop"
    cut = engine.generate([4, 5], SamplingParams(regex="[#%&]{3}", max_new_tokens=2))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2
