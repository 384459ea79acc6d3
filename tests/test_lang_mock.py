"""The frontend language on the deterministic mock backend: semantics, ids, select, fork, batches,
streaming and errors, without a model."""
import asyncio
import threading

import pytest

import stemma
from stemma.lang.backends.mock import BOS, MockBackend, mock_logprob
from stemma.lang.scoring import greedy_token_index
from stemma.lang.tracer import trace


@pytest.fixture
def mock():
    return MockBackend()


def encode(text):
    return [ord(c) for c in text]


@stemma.function
def qa(s, question):
    s += "Q: " + question + "\nA:"
    s += stemma.gen("answer", max_new_tokens=12)
    s += "\nSure? " + stemma.select("sure", ["yes", "no way"])


def test_gen_append_and_read(mock):
    state = qa.run(question="why", backend=mock)
    answer, sure = state["answer"], state["sure"]
    assert len(answer) == 12 and sure in ("yes", "no way")
    assert state.text() == f"Q: why\nA:{answer}\nSure? {sure}"
    assert state.vars() == {"answer": answer, "sure": sure}
    assert state.meta("answer").finish_reason == "length"
    assert qa.run(question="why", backend=mock).text() == state.text()  # deterministic
    assert qa.run(question="how", backend=mock)["answer"] != answer


def test_each_call_extends_the_previous_ids(mock):
    state = qa.run(question="why", backend=mock)
    gen_call, prefill, *choices = mock.calls
    assert list(gen_call.ids) == [BOS, *encode("Q: why\nA:")]
    after_gen = [*gen_call.ids, *encode(state["answer"]), *encode("\nSure? ")]
    assert list(prefill.ids) == after_gen
    assert [list(c.ids) for c in choices] == [after_gen + encode("yes"), after_gen + encode("no way")]
    assert state.token_ids() == after_gen + encode(state["sure"])
    # the radix-like cache of the mock served the generated prefix to the prefill
    assert prefill.cached_tokens == len(gen_call.ids) + len(state["answer"])


def test_stop_string_is_trimmed_from_text_and_ids():
    mock = MockBackend(reply=lambda prompt: " four\nQ: next")

    @stemma.function
    def prog(s):
        s += "Q: 2+2\nA:" + stemma.gen("a", stop="\n") + "\nDone" + stemma.gen("b", max_new_tokens=3)

    state = prog.run(backend=mock)
    assert state["a"] == " four"
    second = mock.calls[1].ids
    assert list(second) == [BOS, *encode("Q: 2+2\nA: four\nDone")]  # no stray "\n" from the stop


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token",
                                    "unconditional_likelihood_normalized"])
def test_select_matches_a_hand_computation(mock, method):
    choices = ["red", "green", "blue sky"]

    @stemma.function
    def pick(s):
        s += "Colour: " + stemma.select("c", choices, method=method)

    state = pick.run(backend=mock)
    prefix = [BOS, *encode("Colour: ")]
    cond = [[mock_logprob(prefix + encode(c)[:j], encode(c)[j]) for j in range(len(c))] for c in choices]
    uncond = [[mock_logprob([BOS] + encode(c)[:j], encode(c)[j]) for j in range(len(c))] for c in choices]
    if method == "unconditional_likelihood_normalized":
        scores = [sum(a - b for a, b in zip(ci, ui)) / len(ci) for ci, ui in zip(cond, uncond)]
    else:
        scores = [sum(ci) / len(ci) for ci in cond]
    best = greedy_token_index(cond) if method == "greedy_token" else scores.index(max(scores))
    result = state.meta("c")
    assert result.scores == pytest.approx(scores, abs=1e-12)
    assert state["c"] == choices[best] == result.choice
    # one prefill of the prefix, then every choice (and its unconditional twin) in one batch
    assert mock.batches == [len(choices) * (2 if method.startswith("unconditional") else 1)]
    assert [c.params.max_new_tokens for c in mock.calls] == [0] * (1 + mock.batches[0])
    assert all(c.cached_tokens == len(prefix) - 1 for c in mock.calls[1:1 + len(choices)])


def test_greedy_token_selection_rule():
    assert greedy_token_index([[-1.0, -9.0], [-1.0, -2.0], [-3.0]]) == 1
    assert greedy_token_index([[-1.0], [-1.0, -0.5]]) == 1  # the ended choice competes with its mean
    assert greedy_token_index([[-2.0], [-2.0]]) == 0


def test_fork_commits_the_prefix_once_and_join_gathers(mock):
    @stemma.function
    def tree(s):
        s += "Task: plan a trip. " * 10
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"Idea {i}:" + stemma.gen("idea", max_new_tokens=6)
        forks.join()
        s += "Best: " + stemma.select("best", ["0", "1", "2"])

    state = tree.run(backend=mock)
    prefix_len = 1 + len("Task: plan a trip. " * 10)
    first, *branch_calls = mock.calls[:4]
    assert first.params.max_new_tokens == 0 and len(first.ids) == prefix_len  # the commit
    assert all(c.cached_tokens >= prefix_len for c in branch_calls)
    ideas = state["idea"]
    assert len(ideas) == 3 and all(len(i) == 6 for i in ideas)
    assert "Idea" not in state.text()  # branches do not write into the parent
    usage = state.usage()
    assert usage.calls == 1 + 3 + 1 + 3  # commit, branches, select's prefill and choices
    assert usage.cached_tokens >= 3 * prefix_len


def test_join_gives_none_for_a_branch_that_did_not_write_the_variable(mock):
    """Even where the parent had written it before the fork (the inherited value came back)."""
    @stemma.function
    def prog(s):
        s += "start" + stemma.gen("x", max_new_tokens=4)
        forks = s.fork(2)
        forks[0] += stemma.gen("x", max_new_tokens=4)
        forks[1] += stemma.gen("y", max_new_tokens=4)
        forks.join()

    state = prog.run(backend=mock)
    (x0, x1), (y0, y1) = state["x"], state["y"]
    assert x0 is not None and y1 is not None and x1 is None and y0 is None


def test_fork_branch_reads_and_keeps_parent_vars(mock):
    @stemma.function
    def prog(s):
        s += "x" + stemma.gen("a", max_new_tokens=4)
        a, b = s.fork(2)
        a += stemma.gen("b", max_new_tokens=2)
        b += "!"
        return a["a"], a["b"], b.text()

    state = prog.run(backend=mock)
    parent_a, branch_b, text_b = state.return_value
    assert parent_a == state["a"] and len(branch_b) == 2
    assert text_b == "x" + state["a"] + "!"


def test_bodies_wait_on_one_thread_concurrently():
    active, peak = [0], [0]

    class Slow(MockBackend):
        async def generate(self, ids, params, on_text=None):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            await asyncio.sleep(0.01)
            active[0] -= 1
            return await super().generate(ids, params, on_text)

    @stemma.function
    def agent(s, i):
        s += f"step {i}:"
        for _ in range(3):
            s += stemma.gen("x", max_new_tokens=3)
            if s["x"] == "never":  # a read in the body waits for the model
                break

    threads = threading.active_count()
    states = agent.run_batch([{"i": i} for i in range(10)], backend=Slow(), max_concurrency=4)
    assert threading.active_count() == threads
    assert peak[0] == 4  # four bodies waiting at once, and never more
    assert [len(s.calls()) for s in states] == [3] * 10


def test_run_batch_returns_every_state_when_a_call_fails():
    """As in SGLang: a program whose model call failed is a state with its error(), the others'
    results stand (they were all lost); an exception of a body still ends the batch."""
    def reply(prompt):
        if "Q2:" in prompt:
            raise RuntimeError("the server refused program 2's request")
        return " fine"

    @stemma.function
    def prog(s, i):
        s += f"Q{i}:" + stemma.gen("a", max_new_tokens=5)
        if i == 3:
            s += "then" + stemma.gen("b", max_new_tokens=2)

    states = prog.run_batch([{"i": i} for i in range(5)], backend=MockBackend(reply=reply))
    assert [s.error() is None for s in states] == [True, True, False, True, True]
    assert "refused program 2" in str(states[2].error())
    assert [states[i]["a"] for i in (0, 1, 3, 4)] == [" fine"] * 4 and states[3]["b"]

    @stemma.function
    def buggy(s, i):
        s += "x" + stemma.gen("a", max_new_tokens=2)
        if i == 1:
            raise KeyError("a bug in the body")

    with pytest.raises(KeyError, match="a bug in the body"):
        buggy.run_batch([{"i": i} for i in range(3)], backend=MockBackend())


def test_run_batch_prefills_the_traced_prefix(mock, capsys):
    @stemma.function
    def classify(s, text):
        s += stemma.system("Label reviews.")
        s += "Review: great!\nLabel: positive\n" * 20
        s += "Review: " + text + "\nLabel:"
        s += stemma.select("label", [" positive", " negative"])

    prefix = classify.trace()
    assert prefix.render(mock.chat_template).startswith("System: Label reviews.\nReview: great!")
    assert prefix.render(mock.chat_template).endswith("Label: positive\n")
    states = classify.run_batch([{"text": f"item {i}"} for i in range(16)], backend=mock,
                                progress_bar=True)
    assert "16/16" in capsys.readouterr().err
    assert states.prefill is not None and states.prefill.cached_tokens == 0
    prefix_len = states.prefill.prompt_tokens
    first_calls = [s.calls()[0] for s in states]
    assert all(c.cached_tokens >= prefix_len for c in first_calls)
    assert states.usage().cached_tokens >= 16 * prefix_len
    assert [s["label"] for s in states] == [classify.run(text=f"item {i}", backend=mock)["label"]
                                            for i in range(16)]


def test_trace_stops_at_the_first_dependent_thing():
    def body(s, q):
        s += "a"
        s += stemma.user("b")
        s += f"c {q}"
        s += "never"

    assert [getattr(n, "value", getattr(n, "role", None)) for n in trace(body).nodes] == \
        ["a", "user", "b", "user"]

    def body2(s):
        s += "x" + stemma.gen("y") + "z"

    assert [n.value for n in trace(body2).nodes] == ["x"]


def test_streaming_sync_and_async(mock):
    state = qa.run(question="why", backend=mock, stream=True)
    deltas = list(state.text_iter())
    assert len(deltas) > 12 and "".join(deltas) == state.text()
    assert "".join(qa.run(question="why", backend=mock, stream=True).text_iter(generated_only=True)) \
        == state["answer"] + state["sure"]

    async def main():
        s = await qa.run_async(question="why", backend=mock, stream=True)
        parts = [d async for d in s.text_aiter()]
        return "".join(parts), s.text()

    joined, text = asyncio.run(main())
    assert joined == text == state.text()


def test_a_streamed_run_s_variable_read_before_its_text_waits_for_it(mock):
    """The body of a streamed run goes as its text is read: a read from outside that comes
    first waits for the variable (it was VariableNotGenerated, and `in` False), as on SGLang,
    and the text stays there to iterate."""
    plain = qa.run(question="why", backend=mock)
    state = qa.run(question="why", backend=mock, stream=True)
    assert state["answer"] == plain["answer"] and "sure" in state
    assert "".join(state.text_iter()) == plain.text()
    with pytest.raises(stemma.VariableNotGenerated):
        qa.run(question="why", backend=mock, stream=True)["never"]


def test_roles_and_messages(mock):
    @stemma.function
    def chat(s):
        s += stemma.system("Be brief.")
        s += stemma.user("Hi?")
        s += stemma.assistant(stemma.gen("reply", max_new_tokens=5))
        s += stemma.user_begin() + "Bye" + stemma.user_end()

    state = chat.run(backend=mock)
    reply = state["reply"]
    assert state.messages() == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi?"},
                                {"role": "assistant", "content": reply.lstrip()},  # as SGLang's
                                {"role": "user", "content": "Bye"}]
    assert state.text() == f"System: Be brief.\nUser: Hi?\nAssistant: {reply}\nUser: Bye\n"
    gen_call = mock.calls[0]
    assert "\nUser:" in gen_call.params.stop  # a turn's gen stops where the next turn would start


def test_sampling_defaults_and_overrides(mock):
    @stemma.function
    def prog(s):
        s += "a" + stemma.gen("x") + stemma.gen("y", max_new_tokens=2, temperature=0.5)

    prog.run(backend=mock, sampling={"max_new_tokens": 7, "temperature": 0})
    assert [(c.params.max_new_tokens, c.params.temperature) for c in mock.calls] == [(7, 0), (2, 0.5)]


def test_default_backend_is_the_context_s_else_the_process_s(mock):
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    from stemma.lang.context import _DEFAULT, get_backend

    def inner():
        stemma.set_default_backend(mock)
        return qa.run(question="ctx")["answer"]

    assert contextvars.copy_context().run(inner) == qa.run(question="ctx", backend=mock)["answer"]
    assert _DEFAULT.get() is None  # the outer context's own is untouched...
    assert get_backend() is mock   # ...and without one it takes the process's, as SGLang's is
    other = MockBackend()
    contextvars.copy_context().run(lambda: stemma.set_default_backend(other))
    assert get_backend() is other
    stemma.set_default_backend(mock)
    with ThreadPoolExecutor(2) as pool:  # threads start with empty contexts: they started the
        answers = list(pool.map(lambda q: qa.run(question=q)["answer"], ["a", "b"]))  # embedded model
    assert answers == [qa.run(question=q, backend=mock)["answer"] for q in ["a", "b"]]


def test_errors_name_what_went_wrong(mock):
    with pytest.raises(stemma.VariableNotGenerated, match="'missing' was never generated.*answer"):
        qa.run(question="q", backend=mock)["missing"]

    @stemma.function
    def reads_early(s):
        s += "a" + stemma.gen("x", max_new_tokens=2)
        s["y"]

    with pytest.raises(stemma.VariableNotGenerated, match="'y'"):
        reads_early.run(backend=mock)
    with pytest.raises(ValueError, match="unknown SamplingParams fields: max_tokns"):
        stemma.gen("x", max_tokns=3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        stemma.gen("x", temperature=-1)
    with pytest.raises(ValueError, match="fork the state"):
        stemma.gen("x", n=2)
    with pytest.raises(ValueError, match="method must be one of"):
        stemma.select("x", ["a"], method="best")
    with pytest.raises(ValueError, match="sampling defaults cannot set n"):
        qa.run(question="q", backend=mock, sampling={"n": 2})
    with pytest.raises(TypeError, match="program qa: missing a required argument: 'question'"):
        qa.run(backend=mock)
    with pytest.raises(TypeError, match="appends text or stemma expressions .*got int"):
        @stemma.function
        def bad(s):
            s += 3
        bad.run(backend=mock)
    with pytest.raises(TypeError, match="'backend' is reserved"):
        stemma.function(lambda s, backend: None)

    @stemma.function
    def nested(s):
        s += stemma.user_begin() + stemma.assistant_begin()

    with pytest.raises(stemma.lang.RoleError, match="cannot open a assistant turn inside the open user"):
        nested.run(backend=mock)

    async def in_loop():
        qa.run(question="q", backend=mock)

    with pytest.raises(RuntimeError, match="use `await qa.run_async"):
        asyncio.run(in_loop())


def test_backend_failure_reaches_the_reader():
    class Broken(MockBackend):
        async def generate(self, ids, params, on_text=None):
            raise ConnectionError("model went away")

    with pytest.raises(ConnectionError, match="model went away"):
        qa.run(question="q", backend=Broken())


def test_a_call_that_ends_in_error_fails_the_program():
    """A request the server ended with finish_reason "error" (a constraint that did not compile in
    time, a failed step) is no value: the program stops with GenerationFailed, as SGLang's
    executor stores the error (it read as "" and the program went on)."""
    import dataclasses

    class Failing(MockBackend):
        async def generate(self, ids, params, on_text=None):
            out = await super().generate(ids, params, on_text)
            return dataclasses.replace(out, text="", token_ids=[], finish_reason="error",
                                       meta={**out.meta, "error": "regex: compiling took too long"})

    @stemma.function
    def prog(s):
        s += "JSON:" + stemma.gen("json", regex=r"\{[a-z]+\}") + "\nDone."

    with pytest.raises(stemma.GenerationFailed, match="gen 'json' failed: regex: compiling took too long"):
        prog.run(backend=Failing())
    batch = prog.run_batch([{}, {}], backend=Failing())
    assert all(isinstance(state.error(), stemma.GenerationFailed) for state in batch)


def test_the_mock_returns_the_logprobs_a_gen_asks_for(mock):
    @stemma.function
    def scored(s):
        s += "a" + stemma.gen("x", max_tokens=4, return_logprob=True, top_logprobs_num=3) + stemma.gen("y", max_tokens=2)

    state = scored.run(backend=mock)
    info, out = state.get_meta_info("x"), state.meta("x")
    assert [t for _, t, _ in info["output_token_logprobs"]] == out.token_ids and len(out.token_ids) == 4
    for pos, (lp, token, _) in zip(info["output_top_logprobs"], info["output_token_logprobs"]):
        assert len(pos) == 3 and (lp, token, None) in pos
        assert [p[0] for p in pos] == sorted((p[0] for p in pos), reverse=True)
    assert state.meta("y").logprobs is None


def test_a_streamed_read_of_a_run_whose_body_failed_raises_its_error():
    """The read waits for the run; a body that raised after queueing the gen closed the executor
    mid-call, and the read then waited on it for ever."""
    class SlowMock(MockBackend):
        async def generate(self, ids, params, on_text=None):
            await asyncio.sleep(0.2)
            return await super().generate(ids, params, on_text)

    @stemma.function
    def failing(s):
        s += "Q:" + stemma.gen("a", max_tokens=5)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        failing.run(backend=SlowMock(), stream=True)["a"]
