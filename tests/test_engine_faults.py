"""Faults inside the engine fail one request, not the engine (issue 17).

In process, on a tiny llama with the tiny word-level tokenizer: for each kind of fault the
faulty request ends with finish reason "error" and req.error, its batch neighbours produce the
greedy tokens they produce without the fault, and the KV pool is whole. Then the two acceptance
tests on a `stemma serve` subprocess, whose faults come from STEMMA_INJECT_FAULTS."""
import time

import pytest
import torch

import stemma
from stemma import SamplingParams
from stemma.constrained.guide import RegexGuide
from stemma.engine import faults
from stemma.engine.request import RequestFailed
from stemma.text.detokenizer import TextStream
from tests.bytelevel_tokenizer import build_tiny_bytelevel
from tests.served import ENGINE, HttpServed
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
VICTIM = "victim"  # the salt of the request a fault targets


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny_tokenizer(build_tiny("llama", tmp_path_factory.mktemp("faults_llama"))))


def make(folder, **kw):
    engine = stemma.Engine(folder, **{**ENGINE, "kv_pool_tokens": 2048, "speculative": "none", **kw})
    if engine.spec is not None:  # every proposal verified at its full length (test_speculative)
        engine.spec.choose = lambda decodes, cands, *_: [most for _, most in cands]
    return engine


def prompts():
    return [[(7 * i + 3 * j) % 90 + 4 for j in range(5 + 9 * i % 23)] for i in range(6)]


@pytest.fixture(scope="module")
def reference(folder):
    engine = make(folder)
    ref = [engine.generate(p, GREEDY).token_ids for p in prompts()]
    assert len({tuple(r) for r in ref}) > 3
    return ref


def run_batch(engine, victim_params=GREEDY, victim_at=2):
    """Every prompt in one batch, prompt `victim_at` salted VICTIM with victim_params; returns
    the requests (one per prompt)."""
    reqs = [engine.submit(p, victim_params if i == victim_at else GREEDY,
                          salt=VICTIM if i == victim_at else None)[0]
            for i, p in enumerate(prompts())]
    engine.run_until_done(reqs)
    return reqs


def assert_isolated(engine, reqs, reference, victim_at=2, error="internal error"):
    victim = reqs[victim_at]
    assert victim.finish_reason == "error" and victim.fault and error in victim.error, victim.error
    assert engine.output(victim).meta["error"] == victim.error
    for i, req in enumerate(reqs):
        if i != victim_at:
            assert req.finish_reason == "length" and req.output_ids == reference[i], i
    engine.check_pool_whole()
    assert engine.stats()["running"] == 0 and engine.stats()["queue"] == 0


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_a_postprocess_fault_fails_its_request_only(folder, reference, monkeypatch, speculative):
    engine = make(folder, speculative=speculative)
    engine.generate(prompts(), GREEDY)  # ngram: its outputs in the tree give drafts that hit
    monkeypatch.setattr(faults, "INJECTED", faults.Faults.parse(f"postprocess:salt={VICTIM}"))
    reqs = run_batch(engine)
    assert_isolated(engine, reqs, reference, error="InjectedFault")
    assert reqs[2].output_ids == []  # it failed on booking its first token


def _nan_rows_of(engine, victim_salt, value):
    """Wraps the runner's forward: the logits rows of the request salted victim_salt get value."""
    forward = engine.runner.forward

    def poisoned(fb):
        logits = forward(fb).clone()
        ends = torch.tensor(fb.logits_counts).cumsum(0).tolist()
        running = {r.row: r for r in engine.scheduler.running}
        for k, row in enumerate(torch.as_tensor(fb.req_rows).tolist()):
            if running[row].salt == victim_salt:
                logits[ends[k] - fb.logits_counts[k]:ends[k]] = value
        return logits
    return poisoned


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_nan_or_inf_logits_fail_their_row_only(folder, reference, monkeypatch, value, prompt_logprobs):
    engine = make(folder)
    monkeypatch.setattr(engine.runner, "forward", _nan_rows_of(engine, VICTIM, value))
    params = GREEDY.replace(logprob_start=0) if prompt_logprobs else GREEDY
    reqs = run_batch(engine, params)
    assert_isolated(engine, reqs, reference, error="NaN or inf")


@pytest.fixture(scope="module")
def bytelevel(tmp_path_factory):
    return str(build_tiny_bytelevel(tmp_path_factory.mktemp("faults_bytelevel")))


CONSTRAINED = GREEDY.replace(regex="[a-z]+( [a-z]+)*", max_new_tokens=16)


def guided_batch(engine, victim_at, guided=3):
    """prompts() with the first `guided` constrained; the one at victim_at salted VICTIM. Steps
    until the victim has its guide and an output token; returns the requests."""
    reqs = [engine.submit(p, CONSTRAINED if i < guided else GREEDY,
                          salt=VICTIM if i == victim_at else None)[0] for i, p in enumerate(prompts())]
    victim = reqs[victim_at]
    for _ in range(200):
        if victim.finished or (victim.constraint is not None and victim.output_ids):
            break
        engine.step() or engine.wait_for_work()
    assert not victim.finished and victim.constraint is not None
    return reqs


def broken(*_):
    raise RuntimeError("the guide broke")


@pytest.mark.parametrize("method", ["accept", "fill_mask"])
def test_a_guide_failing_mid_stream_fails_its_request_only(bytelevel, method):
    engine = make(bytelevel, enable_jump_forward=False)
    baseline = [o.token_ids for o in engine.generate(prompts(), [CONSTRAINED] * 3 + [GREEDY] * 3)]
    reqs = guided_batch(engine, victim_at=1)
    guide = reqs[1].constraint
    assert isinstance(guide, RegexGuide)
    setattr(guide, method, broken)  # accept: after sampling; fill_mask: while masking the batch
    engine.run_until_done(reqs)
    victim = reqs[1]
    assert victim.finish_reason == "error" and victim.fault and "the guide broke" in victim.error
    assert [r.output_ids for i, r in enumerate(reqs) if i != 1] == baseline[:1] + baseline[2:]
    engine.check_pool_whole()


@pytest.mark.parametrize("method", ["forced_bytes", "accept_many"])
def test_a_guide_failing_while_drafts_are_planned_fails_its_request_only(bytelevel, method):
    """With speculation, the scheduler asks each guide what text it forces (jump-forward off) and
    how many drafts it accepts before the step runs: a guide raising there fails its request
    alone, and the step goes on (it used to raise out of schedule(), leaking the decode slots)."""
    engine = make(bytelevel, enable_jump_forward=False, speculative="ngram")
    baseline = [o.token_ids for o in engine.generate(prompts(), [CONSTRAINED] * 3 + [GREEDY] * 3)]
    reqs = guided_batch(engine, victim_at=1)
    guide = reqs[1].constraint
    setattr(guide, method, broken)
    if method == "accept_many":  # drafts to check every step: the guide is asked each time
        propose = engine.spec.drafter.propose
        engine.spec.drafter.propose = lambda rs, ks: [([5, 6], src) if r is reqs[1] else (t, src)
                                                      for r, (t, src) in zip(rs, propose(rs, ks))]
    engine.run_until_done(reqs)
    victim = reqs[1]
    assert victim.finish_reason == "error" and victim.fault and "the guide broke" in victim.error
    assert [r.output_ids for i, r in enumerate(reqs) if i != 1] == baseline[:1] + baseline[2:]
    engine.check_pool_whole()


def test_a_drafter_failing_leaves_its_steps_without_drafts(folder, reference):
    engine = make(folder, speculative="ngram")

    def failing(reqs, lengths):
        raise RuntimeError("the drafter broke")
    engine.spec.drafter.propose = failing
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.stats()["spec_proposed"] == 0
    engine.check_pool_whole()


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_a_stop_string_detokenizer_fault_fails_its_request_only(folder, reference, monkeypatch,
                                                                speculative):
    marker = "never-seen-stop"
    push, calls = TextStream.push, {}

    def failing(self, token_ids):  # only the victim's stop text tracker has the marker stop
        if marker in self.stops.stops and token_ids:
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] > 4:  # mid-stream: with ngram, among accepted drafts
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return push(self, token_ids)
    engine = make(folder, speculative=speculative)
    engine.generate(prompts(), GREEDY)
    monkeypatch.setattr(TextStream, "push", failing)
    reqs = run_batch(engine, GREEDY.replace(stop=[marker]))
    assert_isolated(engine, reqs, reference, error="UnicodeDecodeError")
    assert len(reqs[2].output_ids) >= 4


def test_a_detokenizer_fault_in_engine_stream_fails_that_stream_only(folder, reference, monkeypatch):
    engine = make(folder)
    neighbours = [engine.submit(p, GREEDY)[0] for i, p in enumerate(prompts()) if i != 2]
    text_stream = engine.text_stream

    def failing_stream(req):
        stream = text_stream(req)
        calls = {"n": 0}
        push = stream.push

        def push_twice_then_fail(ids):
            calls["n"] += 1
            if calls["n"] > 2:
                raise ValueError("bad ids for this tokenizer")
            return push(ids)
        stream.push = push_twice_then_fail
        return stream
    monkeypatch.setattr(engine, "text_stream", failing_stream)
    with pytest.raises(RequestFailed, match="bad ids for this tokenizer"):
        for _ in engine.stream(prompts()[2], GREEDY):
            pass
    engine.run_until_done(neighbours)
    assert [r.output_ids for r in neighbours] == [r for i, r in enumerate(reference) if i != 2]
    engine.check_pool_whole()
    assert engine.stats()["running"] == 0


def test_a_detokenizer_fault_in_output_errors_that_output_only(folder, reference, monkeypatch):
    engine = make(folder)
    reqs = run_batch(engine)
    victim_ids = list(reqs[2].output_ids)
    push = TextStream.push
    monkeypatch.setattr(TextStream, "push", lambda self, ids: (_ for _ in ()).throw(
        ValueError("cannot decode")) if list(ids) == victim_ids else push(self, ids))
    outs = [engine.output(r) for r in reqs]
    assert outs[2].finish_reason == "error" and "cannot decode" in outs[2].meta["error"]
    assert all(o.finish_reason == "length" and o.text for i, o in enumerate(outs) if i != 2)


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_a_forward_fault_fails_the_steps_requests_and_the_engine_goes_on(folder, reference,
                                                                         monkeypatch, speculative):
    engine = make(folder, speculative=speculative, chunked_prefill_size=16)
    longer = GREEDY.replace(max_new_tokens=60)
    # warm: cached prefixes, and the ngram cost fit; the outputs are the reference
    baseline = [o.token_ids for o in engine.generate(prompts(), longer)]
    assert [b[:len(r)] for b, r in zip(baseline, reference)] == reference
    reqs = [engine.submit(p, longer)[0] for p in prompts()]
    engine.step()
    schedule, planned = engine.scheduler.schedule, []

    def arming():  # the first step with drafts (ngram; any step else) gets a failing forward
        plan = schedule()
        if not planned and plan and (plan.drafts or speculative == "none"):
            planned.append(plan)
            monkeypatch.setattr(faults, "INJECTED", faults.Faults.parse("forward:once"))
        return plan
    monkeypatch.setattr(engine.scheduler, "schedule", arming)
    touched = []
    for _ in range(100):
        touched = engine.step()
        if planned:
            break
    step_reqs = planned[0].reqs
    assert step_reqs and set(map(id, touched)) >= set(map(id, step_reqs))
    for req in step_reqs:
        assert req.finish_reason == "error" and req.fault and "InjectedFault" in req.error
    engine.check_pool_whole()
    engine.run_until_done(reqs)
    for req, ref in zip(reqs, baseline):  # the others were not touched
        assert req in step_reqs or req.output_ids == ref
    engine.check_pool_whole()
    assert [o.token_ids for o in engine.generate(prompts(), GREEDY)] == reference  # still serving
    engine.check_pool_whole()


# ---- the acceptance tests: a `stemma serve` subprocess with injected faults ----

SERVE_GREEDY = dict(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LONG = dict(temperature=0.0, max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def served(folder):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faults.ENV, f"postprocess:salt={VICTIM},forward:salt=doomed")
        server = HttpServed(folder)
    client = stemma.connect(server.address)
    assert client.health(timeout=30)
    yield server, client
    client.close()
    assert server.stop() == 0


@pytest.fixture(scope="module")
def serve_reference(folder):
    engine = stemma.Engine(folder, **ENGINE)
    ref = {tuple(p): engine.generate(p, SERVE_GREEDY).token_ids for p in prompts()}
    ref["long"] = engine.generate(prompts()[5], LONG).token_ids
    return ref


def wait_idle(client, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.info()["stats"]
        if stats["running"] == 0 and stats["queue"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_served_postprocess_fault_fails_one_request_and_neighbours_finish(served, serve_reference):
    _, client = served
    ref = serve_reference
    running = client.stream(prompts()[5], LONG)
    next(iter(running))  # in the batch when the victim joins it
    neighbours = [client.stream(p, SERVE_GREEDY) for p in prompts()[:3]]
    victim = client.stream(prompts()[3], SERVE_GREEDY, salt=VICTIM)
    with pytest.raises(stemma.ServerError) as info:
        "".join(victim)
    assert info.value.code == "internal" and "InjectedFault" in str(info.value)
    for p, stream in zip(prompts(), neighbours):
        "".join(stream)
        assert stream.output.finish_reason == "length" and stream.token_ids == ref[tuple(p)]
    "".join(running)
    assert running.output.finish_reason == "length" and running.token_ids == ref["long"]
    with pytest.raises(stemma.ServerError, match="InjectedFault"):  # n > 1: the group fails as one
        client.generate(prompts()[4], dict(SERVE_GREEDY, n=3, temperature=0.8), salt=VICTIM, timeout=30)
    assert client.generate(prompts()[5], SERVE_GREEDY, timeout=30).token_ids == ref[tuple(prompts()[5])]
    stats = wait_idle(client)
    assert client.info()["stats"]["pool_whole"] is True, stats


def test_served_forward_fault_fails_the_step_and_the_server_keeps_serving(served, serve_reference):
    _, client = served
    ref = serve_reference
    running = client.stream(prompts()[0], LONG)
    next(iter(running))  # it is in the batch when the doomed request joins it
    doomed = client.stream(prompts()[1], SERVE_GREEDY, salt="doomed")
    for stream in (doomed, running):  # both ran the step whose forward raised
        with pytest.raises(stemma.ServerError) as info:
            "".join(stream)
        assert info.value.code == "internal" and "internal error in the step" in str(info.value)
    outs = client.generate(prompts(), SERVE_GREEDY, timeout=60)
    assert [o.token_ids for o in outs] == [ref[tuple(p)] for p in prompts()]
    wait_idle(client)
    assert client.info()["stats"]["pool_whole"] is True


def test_a_fault_taking_in_a_message_fails_that_message_only(folder, monkeypatch):
    """The engine process's loop: an exception other than ValueError while a request is taken
    in (a compiler's TypeError, ...) escaped the loop and ended the process, failing every
    request in it; now its sender gets an INTERNAL error and the loop goes on."""
    from stemma import protocol as P
    from stemma.engine.process import EngineLoop
    engine = make(folder)
    loop = EngineLoop(engine, requests=None, outputs=None)
    real = engine.submit

    def submit(prompt, params=None, **kw):
        if kw.get("rid") == "bad":
            raise TypeError("unhashable type: 'list'")
        return real(prompt, params, **kw)

    monkeypatch.setattr(engine, "submit", submit)
    loop.handle(P.GenerateReq(rid="bad", input_ids=[5, 6], params=SamplingParams(max_new_tokens=2)))
    (error,) = loop.outbox
    assert (error.rid, error.code) == ("bad", P.INTERNAL) and "TypeError" in error.message
    loop.handle(P.GenerateReq(rid="ok", input_ids=[5, 6], params=SamplingParams(max_new_tokens=2)))
    assert list(loop.groups) == ["ok"]
