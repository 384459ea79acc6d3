"""SGLang's frontend API on stemma (`import stemma as sgl`), on the deterministic mock backend:
each name of docs/from-sglang.md, as an SGLang program uses it."""
import asyncio
import json
import re
import socket
import threading
import time

import pytest

import stemma as sgl
from stemma.lang.backends.mock import BOS, MockBackend
from stemma.lang.backends.speculative import SpeculativeBackend
from stemma.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, Gen, Select
from stemma.lang.tracer import trace


@pytest.fixture
def mock():
    return MockBackend()


def encode(text):
    return [ord(c) for c in text]


def params_of(mock):
    return [c.params for c in mock.calls]


# ---- run, run_batch and a direct call take sampling options as keyword arguments ----
@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=12)


def test_run_takes_sampling_options_as_keywords(mock):
    state = qa.run(question="why", backend=mock, temperature=0, top_p=0.9, top_k=5, min_p=0.1,
                   frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.1,
                   stop=["\n"], stop_token_ids=[7], ignore_eos=True, max_new_tokens=40)
    (p,) = params_of(mock)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0, 0.9, 5, 0.1)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.stop == ("\n",) and p.stop_token_ids == (7,) and p.ignore_eos
    assert p.max_new_tokens == 12  # the gen's own max_tokens overrides the run's default
    assert len(state["answer"]) == 12
    # sampling= still works, and both together; a field given twice is named
    qa.run(question="why", backend=mock, sampling={"top_k": 3}, temperature=0.25)
    assert (mock.calls[-1].params.top_k, mock.calls[-1].params.temperature) == (3, 0.25)
    with pytest.raises(ValueError, match="temperature is given twice"):
        qa.run(question="why", backend=mock, sampling={"temperature": 0}, temperature=0.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        qa.run(question="why", backend=mock, temperature=-1)


def test_sglang_option_names_in_run(mock):
    qa.run(question="q", backend=mock, return_logprob=True, top_logprobs_num=2,
           return_text_in_logprobs=True, logprob_start_len=None)
    p = mock.calls[-1].params
    assert p.logprobs and p.top_logprobs == 2
    with pytest.raises(NotImplementedError, match="logprob_start_len is not supported"):
        qa.run(question="q", backend=mock, logprob_start_len=3)
    with pytest.raises(ValueError, match="sampling defaults cannot set n"):
        qa.run(question="q", backend=mock, n=2)


def test_a_name_both_argument_and_option_is_an_error(mock):
    @sgl.function
    def styled(s, temperature, topic="x"):
        s += f"{temperature} {topic}:" + sgl.gen("out", max_tokens=3)

    with pytest.raises(TypeError, match="'temperature' is both a parameter of the program and a "
                                        "sampling option"):
        styled.run(temperature="warm", backend=mock)
    state = styled.run("warm", backend=mock, top_k=2)  # positionally, it is the program's
    assert state.text().startswith("warm x:") and mock.calls[-1].params.top_k == 2
    with pytest.raises(TypeError, match="program qa: got an unexpected keyword argument 'temprature'"):
        qa.run(question="q", backend=mock, temprature=0)

    @sgl.function
    def parallel_sample(s, question, n, seed=None):  # SGLang's example: run() passes n on
        s += question + str(seed)
        forks = s.fork(n)
        forks += sgl.gen("answer", max_tokens=2)

    state = parallel_sample.run(question="Q", n=3, seed=7, backend=mock, temperature=0.5)
    assert state.text() == "Q7" and mock.calls[-1].params.temperature == 0.5
    assert mock.calls[-1].params.seed is None  # the program's seed, not a sampling option


def test_run_batch_takes_options_num_threads_and_progress_bar(mock, capsys):
    states = qa.run_batch([{"question": f"q{i}"} for i in range(5)], backend=mock,
                          temperature=0.1, max_new_tokens=9, num_threads=2, progress_bar=True)
    assert len(states) == 5 and all(len(s["answer"]) == 12 for s in states)
    assert {(p.temperature, p.top_k) for p in params_of(mock) if p.max_new_tokens} == {(0.1, -1)}
    assert "qa: 100%" in capsys.readouterr().err  # tqdm
    assert qa.run_batch([["positional"]], backend=mock)[0].text().startswith("Q: positional")
    assert list(qa.run_batch([], backend=mock)) == []
    with pytest.raises(TypeError, match="unexpected keyword argument 'question'"):
        qa.run_batch([{"question": "a"}], backend=mock, question="b")
    with pytest.raises(ValueError, match="num_threads .* and max_concurrency are the same option"):
        qa.run_batch([{"question": "a"}], backend=mock, num_threads=2, max_concurrency=3)


def test_num_threads_bounds_the_programs_running_at_once():
    class Counting(MockBackend):
        running = peak = 0

        async def generate(self, ids, params, on_text=None):
            Counting.running += 1
            Counting.peak = max(Counting.peak, Counting.running)
            await asyncio.sleep(0.01)
            try:
                return await super().generate(ids, params, on_text)
            finally:
                Counting.running -= 1

    qa.run_batch([{"question": f"q{i}"} for i in range(6)], backend=Counting(), num_threads=2)
    assert Counting.peak == 2
    Counting.peak = 0
    qa.run_batch([{"question": f"q{i}"} for i in range(6)], backend=Counting(), num_threads="auto")
    assert Counting.peak == 6


def test_direct_call_runs_the_program(mock):
    sgl.set_default_backend(mock)
    try:
        state = qa(question="direct", temperature=0)
        assert state.sync() is state and len(state["answer"]) == 12
        assert mock.calls[-1].params.temperature == 0
        assert qa("positional").text().startswith("Q: positional\nA:")
        streamed = qa(question="direct", temperature=0, stream=True)
        assert streamed.sync()["answer"] == state["answer"]

        @sgl.function
        def outer(s):  # a direct call with the state composes, as before
            qa(s, "inner")
            s += "!"

        assert outer().text() == qa("inner").text() + "!"
    finally:
        from stemma.lang.context import _DEFAULT
        _DEFAULT.set(None)


# ---- gen: SGLang's names, stemma's names, dtype, choices ----
def test_gen_takes_sglang_names():
    g = sgl.gen("x", 16, min_tokens=2, stop="\n", stop_token_ids=[3], temperature=0, top_p=0.5,
                top_k=4, min_p=0.2, frequency_penalty=0.1, presence_penalty=0.2, ignore_eos=False,
                return_logprob=True, top_logprobs_num=3, regex="[a-z]+")
    assert isinstance(g, Gen) and dict(g.params) == {
        "max_new_tokens": 16, "min_new_tokens": 2, "stop": ("\n",), "stop_token_ids": (3,),
        "temperature": 0, "top_p": 0.5, "top_k": 4, "min_p": 0.2, "frequency_penalty": 0.1,
        "presence_penalty": 0.2, "ignore_eos": False, "logprobs": True, "top_logprobs": 3,
        "regex": "[a-z]+"}
    assert sgl.gen().params == () and sgl.gen(None, None, stop=None).params == ()  # None: unset
    assert dict(sgl.gen("x", max_new_tokens=5, seed=1).params) == {"max_new_tokens": 5, "seed": 1}
    assert dict(sgl.gen(json_schema={"type": "integer"}).params) == {"json_schema": '{"type":"integer"}'}
    assert sgl.gen("x", n=1).params == ()
    with pytest.raises(ValueError, match="max_tokens and max_new_tokens are the same option"):
        sgl.gen("x", max_tokens=3, max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="stop_regex is not supported"):
        sgl.gen("x", stop_regex=r"\d")
    with pytest.raises(ValueError, match="fork the state"):
        sgl.gen("x", n=2)
    with pytest.raises(ValueError, match="min_new_tokens must be <= max_new_tokens"):
        sgl.gen("x", max_tokens=2, min_tokens=3)


def test_min_tokens_reaches_the_request(mock):
    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("x", max_tokens=8, min_tokens=4, stop="\n")

    prog.run(backend=mock)
    assert (mock.calls[0].params.min_new_tokens, mock.calls[0].params.max_new_tokens) == (4, 8)


def test_regex_constants():
    ints, floats = re.compile(REGEX_INT), re.compile(REGEX_FLOAT)
    assert all(ints.fullmatch(v) for v in ["0", "24", "-7", "365\n", "12 ", "9" * 18])
    assert not any(ints.fullmatch(v) for v in ["", "1.5", "0012", "abc", "12\n\n", "9" * 19])
    assert all(floats.fullmatch(v) for v in ["3.14", "-0.5", "2", "6.02e23", "1.5\n"])
    assert not any(floats.fullmatch(v) for v in [".5", "1.", "x"])
    assert re.fullmatch(REGEX_BOOL, "True") and re.fullmatch(REGEX_BOOL, "False")
    assert re.fullmatch(REGEX_STR, '"Paris, France"') and not re.fullmatch(REGEX_STR, '"a"b"')
    for value in ["24", "-3", "2.5", '"x y"']:  # every constant's values are JSON values
        json.loads(value)


def test_dtype_gen_int_and_gen_string():
    for dtype, regex in [(int, REGEX_INT), (float, REGEX_FLOAT), (bool, REGEX_BOOL),
                         (str, REGEX_STR), ("int", REGEX_INT)]:
        assert dict(sgl.gen("v", dtype=dtype).params) == {"regex": regex}
    assert dict(sgl.gen_int("h", 8).params) == {"regex": REGEX_INT, "max_new_tokens": 8}
    assert dict(sgl.gen_string(stop="\n").params) == {"regex": REGEX_STR, "stop": ("\n",)}
    with pytest.raises(ValueError, match="dtype must be int, float, bool or str"):
        sgl.gen("v", dtype=list)
    with pytest.raises(ValueError, match="cannot be combined with regex"):
        sgl.gen("v", dtype=int, regex="[0-9]")


def test_dtype_values_are_read_as_sglang_reads_them():
    answers = iter(["24\n", "3.5", "True", '"DNS"'])
    mock = MockBackend(reply=lambda prompt: next(answers))

    @sgl.function
    def dtype_gen(s):
        s += "hours: " + sgl.gen_int("h") + "\n"
        s += "pi: " + sgl.gen("pi", dtype=float) + "\n"
        s += "sky blue: " + sgl.gen("blue", dtype=bool) + "\n"
        s += "name: " + sgl.gen_string("name") + "\n"

    state = dtype_gen.run(backend=mock)
    assert [c.params.regex for c in mock.calls] == [REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR]
    state["h"] = int(state["h"])  # SGLang programs convert in place
    assert state["h"] == 24 and float(state["pi"]) == 3.5 and state["blue"] == "True"
    assert json.loads(state["name"]) == "DNS"


def test_gen_with_choices_is_a_select(mock):
    node = sgl.gen("pick", choices=["yes", "no"], choices_method=sgl.greedy_token_selection)
    assert node == Select("pick", ("yes", "no"), "greedy_token")

    @sgl.function
    def prog(s):
        s += "Sure? " + sgl.gen("pick", choices=["yes", "no"])

    assert prog.run(backend=mock)["pick"] in ("yes", "no")
    assert mock.batches == [2]
    assert sgl.select(None, ["a", "b"], 0.0, sgl.unconditional_likelihood_normalized).method \
        == "unconditional_likelihood_normalized"
    assert sgl.select("x", choices=["a"], choices_method=sgl.token_length_normalized).method \
        == "token_length_normalized"
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.select("x", ["a", "b"], temperature=0.7)
    with pytest.raises(ValueError, match="choices must be a list"):
        sgl.select("x")


# ---- roles and scopes on the state ----
def test_role_context_managers(mock):
    @sgl.function
    def chat(s, q1, q2):
        s += sgl.system("Be brief.")
        s.user(q1)                                    # with content: appends the turn
        s += sgl.assistant(sgl.gen("a1", max_tokens=5))
        with s.user():
            s += q2
        with s.assistant():
            s += sgl.gen("a2", max_tokens=5)
        with s.system():
            s += "done"

    state = chat.run(q1="Hi?", q2="Bye?", backend=mock)
    a1, a2 = state["a1"], state["a2"]
    assert state.messages() == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi?"},
                                {"role": "assistant", "content": a1.lstrip()},  # as SGLang's
                                {"role": "user", "content": "Bye?"},
                                {"role": "assistant", "content": a2.lstrip()},
                                {"role": "system", "content": "done"}]
    assert state.text() == (f"System: Be brief.\nUser: Hi?\nAssistant: {a1}\nUser: Bye?\n"
                            f"Assistant: {a2}\nSystem: done\n")
    assert "\nUser:" in mock.calls[1].params.stop  # the gen inside `with s.assistant()` stops there
    assert sgl.user().parts[0].role == "user" and len(sgl.user(None).parts) == 2  # an empty turn


def test_role_scopes_are_traced_into_the_batch_prefix():
    def body(s, q):
        with s.system():
            s += "Answer briefly."
        with s.user():
            s += q

    kinds = [(type(n).__name__, getattr(n, "value", getattr(n, "role", None))) for n in trace(body).nodes]
    assert kinds == [("RoleBegin", "system"), ("Text", "Answer briefly."), ("RoleEnd", "system"),
                     ("RoleBegin", "user")]


def test_var_scope_captures_what_the_block_appends(mock):
    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "calculate(" + sgl.gen("expression", stop=")", max_tokens=10) + ") = "
        with s.var_scope("answer"):
            s += str(lhs * rhs)
        s += "\n"
        with s.var_scope("both"):
            s += "x" + sgl.gen("y", max_tokens=3) + "z"

    state = tool_use(lhs=257, rhs=983, backend=mock)
    assert int(state["answer"]) == 257 * 983
    assert state["both"] == "x" + state["y"] + "z" and state.text().endswith(state["both"])
    assert state.meta("answer") is None


def test_json_through_var_scope_and_regex_constants():
    values = iter(['"Paris"', "2148000", "105", "48.85"])
    mock = MockBackend(reply=lambda prompt: next(values) + " tail")

    @sgl.function
    def decode_json(s):
        s += "A JSON object describing Paris:\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen(regex=REGEX_STR, stop=" ") + ",\n"
            s += '  "population": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "area": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
            s += "}"

    obj = json.loads(decode_json.run(backend=mock, temperature=0)["json_output"])
    assert obj == {"name": "Paris", "population": 2148000, "area": 105, "latitude": 48.85}


def test_set_var_get_var_meta_info_error_and_copy(mock):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", max_tokens=3)
        s["note"] = "set in the body"
        with s.copy() as c:
            c += sgl.gen("inner", max_tokens=2)
        s += "!" + s.get_var("note")

    state = prog.run(backend=mock)
    assert state.text().endswith("!set in the body")
    assert isinstance(state["inner"], list) and [len(v) for v in state["inner"]] == [2]
    state.set_var("y", 5)
    assert state.get_var("y") == 5 and "y" in state
    info = state.get_meta_info("x")
    assert info["completion_tokens"] == 3 and info["finish_reason"] == "length"
    assert state.error() is None


# ---- streaming one variable ----
@sgl.function
def two_vars(s, q):
    s += "Q: " + q + "\nA:" + sgl.gen("answer", max_tokens=10)
    s += "\nAnd:" + sgl.gen("more", max_tokens=6) + sgl.gen(max_tokens=4) + sgl.select("pick", ["yes", "no"])
    with s.var_scope("tail"):
        s += " [" + sgl.gen("last", max_tokens=3) + "]"


def test_text_iter_by_variable(mock):
    state = two_vars(q="x", backend=mock, stream=True)
    answer = list(state.text_iter("answer"))
    assert len(answer) == 10 and "".join(answer) == state["answer"]  # as generated
    more = list(state.text_iter("more"))  # ends at the unnamed gen that follows it
    assert len(more) == 6 and "".join(more) == state["more"]
    assert list(state.text_iter("pick")) == [state["pick"]]
    tail = "".join(state.text_iter("tail"))
    assert tail == state["tail"] == " [" + state["last"] + "]"
    assert list(state.text_iter("answer")) == [state["answer"]]  # streamed before: all at once
    assert state.text() == two_vars.run(q="x", backend=MockBackend()).text()


def test_text_iter_whole_text_skips_the_marks(mock):
    whole = "".join(two_vars(q="x", backend=mock, stream=True).text_iter())
    assert whole == two_vars.run(q="x", backend=mock).text()
    state = two_vars(q="x", backend=mock, stream=True)
    list(state.text_iter("answer"))
    assert state["answer"] + "".join(state.text_iter()) == whole[len("Q: x\nA:"):]


def test_text_iter_without_stream_gives_the_value_at_once(mock):
    state = two_vars(q="x", backend=mock)
    assert list(state.text_iter("answer")) == [state["answer"]]
    assert list(state.text_iter()) == [state.text()]
    with pytest.raises(sgl.VariableNotGenerated, match="'nope'"):
        list(two_vars(q="x", backend=mock, stream=True).text_iter("nope"))


def test_text_aiter_by_variable(mock):
    async def main():
        state = await two_vars.run_async(q="x", backend=mock, stream=True)
        answer = [d async for d in state.text_async_iter("answer")]
        rest = [d async for d in state.text_aiter()]
        return state, answer, rest

    state, answer, rest = asyncio.run(main())
    assert "".join(answer) == state["answer"] and len(answer) == 10
    assert "".join(rest) == state.text()[len("Q: x\nA:") + 10:]


# ---- forks ----
def test_fork_operations(mock):
    @sgl.function
    def parallel(s):
        s += "Tips:\n"
        forks = s.fork(size=3)                          # SGLang's keyword
        forks += "Tip"                                  # the same to every branch
        forks += lambda i: f" {i + 1}:"                 # per branch
        forks += [" a", " b", " c"]                     # one item per branch
        for i in range(3):
            forks[i] += sgl.gen("detail", 5, stop="\n\n")
        forks.join()
        for i in range(3):
            s += f"Tip {i + 1}:" + forks[i]["detail"] + "\n"
        s += "In summary," + sgl.gen("summary", max_tokens=4)
        return forks

    state = parallel.run(backend=mock)
    forks = state.return_value
    assert [f.text() for f in forks] == [f"Tips:\nTip {i + 1}: {c}" + forks[i]["detail"]
                                         for i, c in enumerate("abc")]
    assert state["detail"] == [f["detail"] for f in forks] and forks.states == forks.branches
    with pytest.raises(ValueError, match="needs one item per branch"):
        forks += ["only one"]
    with pytest.raises(TypeError, match="cannot be replaced"):
        forks[0] = forks[1]


def test_join_concate_and_append(mock):
    @sgl.function
    def parallel_encoding(s, question, context_0, context_1, context_2):
        s += "USER: Please memorize these statements.\n"
        contexts = [context_0, context_1, context_2]
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Question: " + question + "\nASSISTANT:" + sgl.gen("answer", max_tokens=6)

    state = parallel_encoding.run(question="Who?", context_0="A is B.", context_1="C is D.",
                                  context_2="E is F.", backend=mock)
    prefix = "USER: Please memorize these statements.\n"
    body = "Statement 0: A is B.\nStatement 1: C is D.\nStatement 2: E is F.\n"
    assert state.text() == prefix + body + "Question: Who?\nASSISTANT:" + state["answer"]
    commit, gen = mock.calls
    assert commit.params.max_new_tokens == 0 and list(commit.ids) == [BOS, *encode(prefix)]
    assert gen.cached_tokens == len(commit.ids)  # the cache still holds the prefix
    assert list(gen.ids) == [BOS, *encode(prefix + body + "Question: Who?\nASSISTANT:")]
    assert "Statement" not in state.vars()


def test_join_concate_and_append_keeps_generated_text_and_refuses_a_changed_parent(mock):
    @sgl.function
    def gens(s):
        s += "Start."
        forks = s.fork(2)
        forks += lambda i: f" [{i}]" + sgl.gen("g", max_tokens=3)
        forks.join(mode="concate_and_append")
        return forks

    state = gens.run(backend=mock)
    a, b = state.return_value
    assert state.text() == "Start. [0]" + a["g"] + " [1]" + b["g"]

    @sgl.function
    def changed(s):
        s += "Start."
        forks = s.fork(2)
        s += "more"
        forks.join(mode="concate_and_append")

    with pytest.raises(sgl.ProgramError, match="cannot be appended to between the fork and this join"):
        changed.run(backend=mock)

    @sgl.function
    def forked_again(s):  # another fork or a gather join leaves the parent's text as it was
        s += "Start."
        ideas, other = s.fork(2), s.fork(2)
        ideas += sgl.gen("idea", max_tokens=2)
        other += sgl.gen("other", max_tokens=2)
        other.join()
        ideas.join(mode="concate_and_append")
        return ideas

    state = forked_again.run(backend=mock)
    a, b = state.return_value
    assert state.text() == "Start." + a["idea"] + b["idea"] and len(state["other"]) == 2

    @sgl.function
    def bad_mode(s):
        s += "x"
        s.fork(2).join(mode="concat")

    with pytest.raises(ValueError, match="join mode must be one of gather_variable, concate_and_append"):
        bad_mode.run(backend=mock)


# ---- API speculative execution ----
DOC = ("Construct a character.\nName: Ada Lovelace\nBirthday: December 10, 1815\n"
       "Job: Mathematician\n\nThe end.")


def continue_doc(prompt):
    """A model that continues DOC wherever the prompt leaves it."""
    return DOC[len(prompt):] if DOC.startswith(prompt) else " unrelated\n"


def character(s):
    s += "Construct a character.\n"
    s += "Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
    s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"


spec_character = sgl.function(num_api_spec_tokens=64)(character)
plain_character = sgl.function(character)


def test_num_api_spec_tokens_changes_nothing_on_stemma_backends():
    runs = []
    for program in (spec_character, plain_character):
        mock = MockBackend(reply=continue_doc)
        state = program.run(backend=mock)
        runs.append((state.vars(), [(c.ids, c.params) for c in mock.calls], mock.token_usage))
    assert runs[0] == runs[1]
    assert runs[0][0] == {"name": " Ada Lovelace", "birthday": " December 10, 1815",
                          "job": " Mathematician"}
    assert spec_character.num_api_spec_tokens == 64
    with pytest.raises(ValueError, match="num_api_spec_tokens must be an int >= 1"):
        sgl.function(num_api_spec_tokens=0)(character)


def test_num_api_spec_tokens_speculates_without_prefix_reuse():
    class NoReuse(MockBackend):
        reuses_prefix = False  # as OpenAIBackend

    spec, plain = NoReuse(reply=continue_doc), NoReuse(reply=continue_doc)
    assert spec_character.run(backend=spec).vars() == plain_character.run(backend=plain).vars()
    assert len(plain.calls) == 3 and len(spec.calls) == 1  # one request served the three gens
    assert spec.calls[0].params.max_new_tokens == 128 and spec.calls[0].params.stop == ()
    assert spec.token_usage.prompt_tokens < plain.token_usage.prompt_tokens

    # the program departs from the speculation: the gen is sent
    @sgl.function(num_api_spec_tokens=64)
    def departs(s):
        s += "Construct a character.\nName:" + sgl.gen("name", stop="\n") + "\nAge:"
        s += sgl.gen("age", stop="\n")

    other = NoReuse(reply=continue_doc)
    state = departs.run(backend=other)
    assert state["age"] == " unrelated" and len(other.calls) == 2

    # the programs of a batch speculate each for itself: the same prompt sampled five times
    # gave one sample five times (one request), as the batch shared its speculations
    @sgl.function(num_api_spec_tokens=64)
    def pick(s):
        s += "Pick one:" + sgl.gen("x", stop="\n")

    draws = iter(range(100))
    sampled = NoReuse(reply=lambda prompt: f" draw {next(draws)}\nmore")
    states = pick.run_batch([()] * 5, backend=sampled, temperature=1.0, max_concurrency=1)
    assert len({st["x"] for st in states}) == 5
    assert sum(call.params.max_new_tokens > 0 for call in sampled.calls) == 5  # the rest: the prefix's prefill


def test_speculation_cuts_at_max_new_tokens_and_passes_other_requests_through():
    inner = MockBackend(reply=continue_doc)
    backend = SpeculativeBackend(inner, 64)
    codec = backend.codec
    prompt = [BOS, *codec.encode("Construct a character.\nName:")]
    from stemma import SamplingParams
    first = asyncio.run(backend.generate(prompt, SamplingParams(max_new_tokens=4, stop=["\n"])))
    assert first.text == " Ada" and first.finish_reason == "length"
    scored = asyncio.run(backend.generate(prompt, SamplingParams(max_new_tokens=0, logprob_start=2)))
    assert scored.prompt_logprobs is not None and backend.token_usage is inner.token_usage


def test_num_api_spec_tokens_on_the_openai_backend():
    """A fake OpenAI completions server that continues DOC: the same variables, fewer requests
    and fewer prompt tokens billed."""
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi import FastAPI, Request

    app, bodies = FastAPI(), []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        bodies.append(body)
        prompt = body["prompt"]
        text = continue_doc(prompt)[:body["max_tokens"]]
        reason = "length" if len(text) == body["max_tokens"] else "stop"
        for stop in body.get("stop") or ():
            if stop in text:
                text, reason = text[:text.index(stop)], "stop"
        return {"choices": [{"index": 0, "text": text, "finish_reason": reason}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(text)}}

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        results = {}
        for program in (plain_character, spec_character):
            backend = sgl.OpenAI("fake", is_chat_model=False, base_url=f"http://127.0.0.1:{port}/v1",
                                 api_key="k")
            bodies.clear()
            results[program.num_api_spec_tokens] = (program.run(backend=backend).vars(),
                                                    len(bodies), backend.token_usage.prompt_tokens)
            backend.close()
    finally:
        server.should_exit = True
        thread.join(10)
    (plain_vars, plain_requests, plain_tokens), (spec_vars, spec_requests, spec_tokens) = \
        results[None], results[64]
    assert spec_vars == plain_vars == {"name": " Ada Lovelace", "birthday": " December 10, 1815",
                                       "job": " Mathematician"}
    assert (plain_requests, spec_requests) == (3, 1) and spec_tokens < plain_tokens


# ---- backends ----
def test_token_usage_counts_every_request_and_resets(mock):
    state = qa.run(question="why", backend=mock)
    state2 = two_vars.run(q="y", backend=mock)
    usage = mock.token_usage
    total = state.usage() + state2.usage()
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.requests) == \
        (total.prompt_tokens, total.completion_tokens, total.cached_tokens, total.calls)
    assert usage.cached_tokens > 0
    usage.reset()
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (0, 0, 0)
    assert isinstance(usage, sgl.TokenUsage)


def test_set_default_backend_and_global_config(mock):
    import contextvars

    def inner():
        sgl.set_default_backend(mock)
        assert sgl.global_config.default_backend is mock
        other = MockBackend()
        sgl.global_config.default_backend = other
        qa.run(question="q")
        return other

    other = contextvars.copy_context().run(inner)
    assert len(other.calls) == 1 and not mock.calls


def test_runtime_endpoint_takes_an_address():
    from stemma.client.http import HttpClient
    from stemma.client.sync import Client
    from stemma.lang.backends.remote import RemoteBackend

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    http = sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}", connect_timeout=0.5)
    tcp = sgl.RuntimeEndpoint(f"tcp://127.0.0.1:{port}", api_key="k", connect_timeout=0.5)
    assert isinstance(http, RemoteBackend) and isinstance(http.client, HttpClient)
    assert isinstance(tcp.client, Client) and tcp.base_url.startswith("tcp://")
    with pytest.raises(sgl.BackendUnreachable, match=f"127.0.0.1:{port} is unreachable"):
        qa.run(question="q", backend=http)
    http.close()
    tcp.close()
    with pytest.raises(TypeError, match="takes a server address"):
        sgl.RuntimeEndpoint(3)


def test_what_does_not_apply_to_a_text_model_says_so():
    with pytest.raises(NotImplementedError, match="sgl.image .* text-only"):
        sgl.image("example.png")
    with pytest.raises(NotImplementedError, match="sgl.video .* text-only"):
        sgl.video("clip.mp4", num_frames=4)
    for vendor in (sgl.Anthropic, sgl.LiteLLM, sgl.VertexAI):
        with pytest.raises(NotImplementedError, match=f"sgl.{vendor.__name__} is not provided"):
            vendor("model")
    with pytest.raises(NotImplementedError, match="return_meta_data"):
        qa.run(question="q", backend=MockBackend()).text_async_iter("answer", True)


def test_a_select_s_meta_info_is_sglang_s_dict(mock):
    """SGLang's choices_logprob.py reads get_meta_info(select)["input_token_logprobs"]: each
    choice's tokens as (logprob, token id, text), beside normalized_prompt_logprobs."""
    @sgl.function
    def tool_use(s, question):
        s += "To answer this question: " + question + ", I need to use a "
        s += sgl.gen("tool", choices=["calculator", "search engine"])

    state = tool_use.run("What is 5 + 5?", backend=mock)
    result, info = state.meta("tool"), state.get_meta_info("tool")
    assert info["choice"] == state["tool"] == result.choice
    assert info["normalized_prompt_logprobs"] == pytest.approx(list(result.scores))
    for choice, entries, lps in zip(["calculator", "search engine"], info["input_token_logprobs"],
                                    result.token_logprobs):
        assert [lp for lp, _, _ in entries] == list(lps)
        assert [t for _, t, _ in entries] == mock.codec.encode(choice)


def test_sglang_s_api_module_path_ports_by_its_package_name():
    from stemma.lang import api
    for name in ("function", "gen", "select", "set_default_backend", "system", "user", "assistant", "image"):
        assert getattr(api, name) is getattr(sgl, name)
