"""The frontend language on an in-process Engine (a tiny random llama with a word tokenizer):
parity with hand-built engine calls, select against transformers, prefix sharing of fork and
run_batch, and text programs against Python programs."""
import pytest
import torch

import stemma
from stemma import SamplingParams
from stemma.lang.backends.engine import EngineBackend
from tests.tiny_models import build_tiny
from tests.tiny_tokenizer import save_tiny_tokenizer, words

W = words()
GREEDY = dict(temperature=0)


def sentence(n, seed=0):
    return " ".join(W[(seed + 7 * i + i * i) % len(W)] for i in range(n))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = build_tiny("llama", tmp_path_factory.mktemp("lang_llama"))
    return str(save_tiny_tokenizer(path))


@pytest.fixture(scope="module")
def engine(folder):
    return stemma.Engine(folder, dtype="float32", kv_pool_tokens=40000, max_running_requests=64,
                         attention_backend="torch")


@pytest.fixture
def backend(engine):
    assert engine.flush_cache()
    yield EngineBackend(engine)
    engine.check_pool_whole()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["queue"] == 0


@stemma.function
def two_calls(s, question):
    s += sentence(12) + " " + question
    s += stemma.gen("first", max_new_tokens=10, ignore_eos=True)
    s += " " + W[5] + " " + W[6]
    s += stemma.gen("second", max_new_tokens=10, stop=W[9])
    s += " " + W[7] + stemma.select("pick", [W[30], W[31] + " " + W[32], W[40]])


def test_programs_on_several_threads_share_one_engine(engine, backend):
    """f.run() on threads (each its own event loop) over one in-process engine: one program hung
    forever (its waiter was dropped by another loop's driver) and two backends over the engine
    stepped it at once (tensor shape errors)."""
    import threading
    questions = [W[50 + i] for i in range(6)]
    alone = [two_calls.run(question=q, backend=backend, sampling=GREEDY).vars() for q in questions]
    for shared in (backend, engine):  # one backend for all threads; a new one per run
        results = {}

        def work(i, shared=shared, results=results):
            results[i] = two_calls.run(question=questions[i], backend=shared, sampling=GREEDY).vars()

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert [results.get(i) for i in range(len(questions))] == alone


def test_greedy_outputs_equal_hand_built_engine_calls(engine, backend):
    state = two_calls.run(question=W[50], backend=backend, sampling=GREEDY)
    tok = engine.tokenizer

    def enc(text):
        return tok(text, add_special_tokens=False).input_ids

    ids = enc(sentence(12) + " " + W[50])
    first = engine.generate(ids, SamplingParams(max_new_tokens=10, ignore_eos=True, **GREEDY))
    assert state["first"] == first.text and len(first.token_ids) == 10
    ids = ids + first.token_ids + enc(" " + W[5] + " " + W[6])
    second = engine.generate(ids, SamplingParams(max_new_tokens=10, stop=W[9], **GREEDY))
    assert state["second"] == second.text
    # the stop string ends inside the last token: the program keeps the ids of the text before it
    assert second.finish_reason == "stop" and W[9] in tok.decode(second.token_ids[-1:])
    assert W[9] not in second.text
    ids = ids + enc(second.text) + enc(" " + W[7])
    choices = [W[30], W[31] + " " + W[32], W[40]]
    outs = engine.generate([ids + enc(c) for c in choices],
                           SamplingParams(max_new_tokens=0, logprob_start=len(ids)))
    means = [sum(o.prompt_logprobs) / len(o.prompt_logprobs) for o in outs]
    assert state["pick"] == choices[means.index(max(means))]
    assert state.meta("pick").scores == pytest.approx(means, abs=1e-6)
    assert state.token_ids() == ids + enc(state["pick"])


def _hf_choice_logprobs(folder, context, choices):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for choice in choices:
        ids = torch.tensor([context + choice])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        out.append([logp[len(context) + j - 1, t].item() for j, t in enumerate(choice)])
    return out


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token",
                                    "unconditional_likelihood_normalized"])
def test_select_matches_transformers_within_1e4(folder, engine, backend, method):
    choices = [W[3], W[10] + " " + W[11], W[60] + " " + W[61] + " " + W[62]]
    prefix_text = sentence(30, seed=3)

    @stemma.function
    def pick(s):
        s += prefix_text + stemma.select("c", choices, method=method)

    result = pick.run(backend=backend).meta("c")
    tok = engine.tokenizer
    context = tok(prefix_text, add_special_tokens=False).input_ids
    choice_ids = [tok(c, add_special_tokens=False).input_ids for c in choices]
    cond = _hf_choice_logprobs(folder, context, choice_ids)
    if method == "unconditional_likelihood_normalized":  # no BOS: the neutral context is the last token
        uncond = _hf_choice_logprobs(folder, context[-1:], choice_ids)
        expected = [sum(c - u for c, u in zip(ci, ui)) / len(ci) for ci, ui in zip(cond, uncond)]
    else:
        expected = [sum(ci) / len(ci) for ci in cond]
    assert result.scores == pytest.approx(expected, abs=1e-4)
    for got, want in zip(result.token_logprobs, cond):
        assert got == pytest.approx(want, abs=1e-4)
    if method != "greedy_token":
        assert result.index == expected.index(max(expected))


def test_fork_four_branches_share_a_500_token_prefix(engine, backend):
    @stemma.function
    def branches(s):
        s += sentence(500, seed=1)
        forks = s.fork(4)
        for i, branch in enumerate(forks):
            branch += " " + W[i]
            branch += stemma.gen("idea", max_new_tokens=4, **GREEDY)
        forks.join()
        return forks

    before = engine.stats()["cached_tokens"]
    state = branches.run(backend=backend)
    commit = state.calls()[0]
    assert commit.kind == "prefill" and commit.prompt_tokens == 500
    branch_calls = [c for branch in state.return_value for c in branch.calls()]
    assert len(branch_calls) == 4
    assert sum(c.cached_tokens for c in branch_calls) >= 1500
    assert engine.stats()["cached_tokens"] - before >= 1500
    assert len(state["idea"]) == 4


def test_run_batch_serves_the_shared_prefix_from_the_cache(engine, backend):
    shots = sentence(1000, seed=5)

    @stemma.function
    def classify(s, item):
        s += shots
        s += " " + item
        s += stemma.gen("label", max_new_tokens=3, **GREEDY)

    items = [sentence(3, seed=i) for i in range(64)]
    states = classify.run_batch([{"item": it} for it in items], backend=backend, max_concurrency=64)
    prefix_len = states.prefill.prompt_tokens
    assert prefix_len == 1000
    served = sum(min(s.calls()[0].cached_tokens, prefix_len) for s in states)
    assert served >= 0.9 * 64 * prefix_len
    # the same outputs as one program at a time
    for i in (0, 17, 63):
        assert states[i]["label"] == classify.run(item=items[i], backend=backend)["label"]


def test_text_program_equals_python_program(backend):
    source = (sentence(8) + " {question}\n"
              "{gen answer max_tokens=8 stop=\"" + W[9] + "\"} " + W[4] +
              "{select verdict choices=[\"" + W[1] + "\", \"" + W[2] + " " + W[3] + "\"]}"
              " {answer} {gen again max_tokens=5}")

    @stemma.function
    def same(s, question):
        s += sentence(8) + " " + question + "\n"
        s += stemma.gen("answer", max_new_tokens=8, stop=W[9])
        s += " " + W[4]
        s += stemma.select("verdict", [W[1], W[2] + " " + W[3]])
        s += " " + s["answer"] + " "
        s += stemma.gen("again", max_new_tokens=5)

    text_state = stemma.compile_text(source).run(question=W[20], backend=backend, sampling=GREEDY)
    py_state = same.run(question=W[20], backend=backend, sampling=GREEDY)
    assert text_state.vars() == py_state.vars()
    assert text_state.text() == py_state.text()
    assert text_state.token_ids() == py_state.token_ids()


def test_streaming_through_the_engine(backend):
    state = two_calls.run(question=W[50], backend=backend, sampling=GREEDY, stream=True)
    generated = "".join(state.text_iter(generated_only=True))
    assert generated == state["first"] + state["second"] + state["pick"]
    assert two_calls.run(question=W[50], backend=backend, sampling=GREEDY).text() == state.text()


def test_leaving_a_stream_early_cancels_its_run(engine, backend):
    """A reader that stops (break) leaves nothing behind: a streamed program is driven by its
    reader, so its request held its row, unread, and its program never ended."""
    @stemma.function
    def story(s):
        s += sentence(8) + stemma.gen("a", max_new_tokens=200, ignore_eos=True)
        s += stemma.gen("b", max_new_tokens=20, ignore_eos=True)

    state = story.run(backend=backend, sampling=GREEDY, stream=True)
    for i, _ in enumerate(state.text_iter()):
        if i == 3:
            break
    stats = engine.stats()
    assert stats["running"] == 0 and stats["queue"] == 0, stats
    # reads take what the run had (they raised "no running event loop"); a wait is refused
    assert state.text() == sentence(8) and state.vars() == {} and state.usage().completion_tokens == 0
    assert state.get("a") is None and "b" not in state
    with pytest.raises(stemma.ProgramError, match="cancelled before it finished"):
        state.token_ids()


def test_a_bad_prompt_fails_the_program_and_frees_the_engine(engine, backend):
    @stemma.function
    def too_long(s):
        s += sentence(3000)
        s += stemma.gen("x", max_new_tokens=2)

    with pytest.raises(ValueError, match="does not fit the context"):
        too_long.run(backend=backend)


def test_a_failing_body_aborts_the_calls_in_flight(engine, backend):
    @stemma.function
    def doomed(s):
        s += sentence(20)
        long, short = s.fork(2)
        long += stemma.gen("story", max_new_tokens=500, ignore_eos=True)
        short += stemma.gen("x", max_new_tokens=2)
        short["x"]
        short["never"]

    before = engine.stats()["generated_tokens"]
    with pytest.raises(stemma.VariableNotGenerated, match="'never'"):
        doomed.run(backend=backend)
    assert engine.stats()["generated_tokens"] - before < 100  # the long gen was aborted


def test_a_finished_call_wakes_its_program_before_the_next_step(engine, backend, monkeypatch):
    """A program body on its thread reads its call's result and submits its next call between
    two steps, while another program keeps the engine stepping (the settle's slice widened here
    so that a slow machine's thread wake-ups fit in it)."""
    import stemma.lang.backends.engine as engine_backend
    monkeypatch.setattr(engine_backend, "SETTLE_SLICE_S", 0.1)
    monkeypatch.setattr(engine_backend, "SETTLE_S", 1.0)
    steps = engine.scheduler.counters
    finished_at, submitted_at = {}, {}
    submit, step = engine.submit, engine.step

    def counted_submit(prompt, params=None, **kw):
        reqs = submit(prompt, params, **kw)
        submitted_at[params.max_new_tokens] = steps.steps
        return reqs

    def counted_step():
        out = step()
        for req in out:
            if req.finished:
                finished_at[req.params.max_new_tokens] = steps.steps
        return out

    monkeypatch.setattr(engine, "submit", counted_submit)
    monkeypatch.setattr(engine, "step", counted_step)

    @stemma.function
    def both(s):
        long, short = s.fork(2)
        long += W[1] + stemma.gen("x", max_new_tokens=40, ignore_eos=True)
        short += W[2] + stemma.gen("a", max_new_tokens=2, ignore_eos=True)
        short += " " + short["a"] + stemma.gen("b", max_new_tokens=3, ignore_eos=True)
        long["x"], short["b"]

    both.run(backend=backend, sampling=GREEDY)
    assert finished_at[2] < finished_at[40]  # the long call was still running ...
    assert submitted_at[3] == finished_at[2]  # ... and no step ran between the first call's end and the next


def test_a_kept_stop_token_stays_in_the_program_s_ids(engine, backend):
    """With include_stop_str_in_output the text keeps the stop token's text: so do the ids the
    program goes on from (they dropped it, and no longer spelled the text)."""
    prompt = sentence(8)
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    plain = engine.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True, **GREEDY))
    at = next(i for i, t in enumerate(plain.token_ids) if i > 0 and t not in plain.token_ids[:i])
    stop = plain.token_ids[at]  # a token not sampled before it

    @stemma.function
    def kept(s, include):
        s += prompt + stemma.gen("x", max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop],
                                 include_stop_str_in_output=include)

    for include, length in ((True, at + 1), (False, at)):
        state = kept.run(include, backend=backend, sampling=GREEDY)
        assert state["x"] == engine.generate(ids, SamplingParams(max_new_tokens=length, **GREEDY)).text
        assert state.token_ids()[-length:] == plain.token_ids[:length]


def test_an_eos_that_is_a_plain_token_leaves_the_program_s_ids(folder, engine, tmp_path):
    """Its text is left out of the output (as a stop token's): so is its id from what the
    program goes on from (the ids held an EOS the text never showed)."""
    import json
    import shutil
    prompt = sentence(8)
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    plain = engine.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True, **GREEDY))
    at = next(i for i, t in enumerate(plain.token_ids) if i > 0 and t not in plain.token_ids[:i])
    copy = shutil.copytree(folder, tmp_path / "eos")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": plain.token_ids[at]}))
    eos_engine = stemma.Engine(str(copy), dtype="float32", kv_pool_tokens=2048, max_running_requests=4,
                               attention_backend="torch")

    @stemma.function
    def ends(s):
        s += prompt + stemma.gen("x", max_new_tokens=6)

    state = ends.run(backend=EngineBackend(eos_engine), sampling=GREEDY)
    assert state["x"] == engine.generate(ids, SamplingParams(max_new_tokens=at, **GREEDY)).text
    assert state.token_ids()[-at - 1:] == [ids[-1], *plain.token_ids[:at]]


def test_sglang_s_logprobs_are_in_get_meta_info(backend):
    """gen(return_logprob=True, top_logprobs_num=k): get_meta_info carries SGLang's
    output_token_logprobs and output_top_logprobs, (logprob, token id, None) each."""
    @stemma.function
    def scored(s):
        s += sentence(6) + stemma.gen("x", max_tokens=5, ignore_eos=True, return_logprob=True, top_logprobs_num=2)

    state = scored.run(backend=backend, sampling=GREEDY)
    out, info = state.meta("x"), state.get_meta_info("x")
    assert info["output_token_logprobs"] == [(lp, t, None) for t, lp in zip(out.token_ids, out.logprobs)]
    assert len(info["output_token_logprobs"]) == info["completion_tokens"] == 5
    tops = info["output_top_logprobs"]
    assert [len(pos) for pos in tops] == [2] * 5 and all(pos[0][1] == t for pos, t in zip(tops, out.token_ids))

    @stemma.function
    def plain(s):
        s += sentence(6) + stemma.gen("x", max_tokens=5)

    assert "output_token_logprobs" not in plain.run(backend=backend, sampling=GREEDY).get_meta_info("x")
