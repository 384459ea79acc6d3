"""SGLang programs, written as an SGLang user writes them, run unchanged on the default model
(Gemma 3 270M base, through the embedded runtime: no backend set) with `import stemma as sgl`.

The model is small and not instruction-tuned, so the assertions are on structure and types (a
value parses as an int, the JSON loads, the turns are there, the branches joined), never on
what it knows. The module takes about 40 s on 2 cores, most of it starting the runtime.
"""
import json
import re

import pytest

import stemma as sgl
from stemma.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR


@pytest.fixture(scope="module", autouse=True)
def default_backend():
    """The embedded default runtime, started once for the module (the first run would start it)."""
    from stemma.lang.backends.remote import embedded_default
    backend = embedded_default()
    backend.codec
    return backend


def test_few_shot_qa_and_run_batch():
    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\n"
        s += "A: Paris\n"
        s += "Q: What is the capital of Germany?\n"
        s += "A: Berlin\n"
        s += "Q: What is the capital of Italy?\n"
        s += "A: Rome\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n", temperature=0)

    ret = few_shot_qa.run(question="What is the capital of the United States?")
    assert isinstance(ret["answer"], str) and "\n" not in ret["answer"]

    rets = few_shot_qa.run_batch(
        [
            {"question": "What is the capital of Japan?"},
            {"question": "What is the capital of the United Kingdom?"},
            {"question": "What is the capital city of China?"},
        ],
        temperature=0.1,
    )
    answers = [x["answer"].strip() for x in rets]
    assert len(answers) == 3 and all(isinstance(a, str) and "\n" not in a for a in answers)
    assert rets.prefill is not None and rets.usage().cache_hit_rate > 0.5  # the few shots, once


def test_multi_turn_with_role_context_managers():
    @sgl.function
    def answer_mt_bench(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1"))
        with s.user():
            s += question_2
        with s.assistant():
            s += sgl.gen("answer_2")

    ret = answer_mt_bench.run(question_1="Name a city in France.",
                              question_2="Name another one.", temperature=0.7, max_new_tokens=24)
    messages = ret.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    # a turn's content without its leading whitespace, as SGLang's
    assert messages[2]["content"] == ret["answer_1"].lstrip() and messages[4]["content"] == ret["answer_2"].lstrip()
    assert messages[3]["content"] == "Name another one."


def test_gen_int_and_dtype():
    @sgl.function
    def decode_int(s):
        s += "The number of hours in a day is " + sgl.gen_int("hours") + "\n"
        s += "The number of days in a year is " + sgl.gen_int("days") + "\n"

    ret = decode_int.run(temperature=0.1)
    assert isinstance(int(ret["hours"]), int) and isinstance(int(ret["days"]), int)

    @sgl.function
    def dtype_gen(s):
        s += "Q: What is the full name of DNS?\n"
        s += "A: The full name is " + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
        s += "Q: Which year was DNS invented?\n"
        s += "A: " + sgl.gen("int_res", dtype=int) + "\n"
        s += "Q: What is the value of pi?\n"
        s += "A: " + sgl.gen("float_res", dtype=float) + "\n"
        s += "Q: Is the sky blue?\n"
        s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"

    state = dtype_gen.run()
    state["int_res"] = int(state["int_res"])
    state["float_res"] = float(state["float_res"])
    assert isinstance(state["int_res"], int) and isinstance(state["float_res"], float)
    assert state["bool_res"] in ("True", "False")
    assert isinstance(json.loads(state["str_res"]), str)


def test_json_with_var_scope_and_regex_constants():
    @sgl.function
    def decode_json(s):
        s += "Generate a JSON object to describe the basic city information of Paris.\n"
        s += "Here are the JSON object:\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen(regex=REGEX_STR) + ",\n"
            s += '  "population": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "area": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
            s += "}"

    ret = decode_json.run(temperature=0.0)
    obj = json.loads(ret["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int)
    assert isinstance(obj["area"], int) and isinstance(obj["latitude"], (int, float))
    assert ret.text().endswith(ret["json_output"])

    @sgl.function
    def decode_json_dtype(s):
        s += "Generate a JSON object to describe the basic city information of Paris.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen_string() + ",\n"
            s += '  "population": ' + sgl.gen_int() + ",\n"
            s += '  "area": ' + sgl.gen(dtype=int) + ",\n"
            s += '  "country": ' + sgl.gen_string() + "\n"
            s += "}"

    obj = json.loads(decode_json_dtype.run(max_new_tokens=24)["json_output"])
    assert [type(obj[k]) for k in ("name", "population", "area", "country")] == [str, int, int, str]


def test_tool_use_through_a_direct_call():
    def calculate(expression):
        a, b = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", expression).groups()
        return f"{int(a) * int(b)}"

    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "Please perform computations using a calculator. You can use calculate(expression) to get the results.\n"
        s += "For example,\ncalculate(1*2)=2\ncalculate(3*4)=12\n"
        s += "Question: What is the product of " + str(lhs) + " and " + str(rhs) + "?\n"
        s += "Answer: The answer is calculate(" + sgl.gen("expression", regex=r"[0-9]{1,4}\*[0-9]{1,4}") + ") = "
        with s.var_scope("answer"):
            s += calculate(s["expression"])

    lhs, rhs = 257, 983
    ret = tool_use(lhs=lhs, rhs=rhs, temperature=0)
    assert int(ret["answer"]) == int(calculate(ret["expression"]))
    assert ret.text().endswith(") = " + ret["answer"])


def test_react_with_select():
    @sgl.function
    def react(s, question):
        s += """
Question: Which country does the founder of Microsoft live in?
Thought 1: I need to search for the founder of Microsoft.
Action 1: Search [Founder of Microsoft].
Observation 1: The founder of Microsoft is Bill Gates.
Thought 2: I need to search for the country where Bill Gates lives in.
Action 2: Search [Where does Bill Gates live].
Observation 2: Bill Gates lives in the United States.
Thought 3: The answer is the United States.
Action 3: Finish [United States].\n
"""
        s += "Question: " + question + "\n"
        for i in range(1, 4):
            s += f"Thought {i}:" + sgl.gen(stop=[".", "\n"], max_tokens=24) + ".\n"
            s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
            if s[f"action_{i}"] == "Search":
                s += " [" + sgl.gen(stop="]", max_tokens=16) + "].\n"
                s += f"Observation {i}:" + sgl.gen(stop=[".", "\n"], max_tokens=24) + ".\n"
            else:
                s += " [" + sgl.gen("answer", stop="]", max_tokens=16) + "].\n"
                break

    ret = react.run(question="What country does the creator of Linux live in?", temperature=0.1)
    actions = [ret[f"action_{i}"] for i in range(1, 4) if f"action_{i}" in ret]
    assert actions and set(actions) <= {"Search", "Finish"}
    assert ("answer" in ret) == (actions[-1] == "Finish")


def test_parallel_decoding_with_fork_operations():
    max_tokens = 24
    fork_size = 3

    @sgl.function
    def parallel_decoding(s, topic):
        s += "Act as a helpful assistant.\n"
        s += "USER: Give some tips for " + topic + ".\n"
        s += "ASSISTANT: Okay. Here are " + str(fork_size) + " concise tips, each under 8 words:\n"
        for i in range(1, 1 + fork_size):
            s += f"{i}." + sgl.gen(max_tokens=16, stop=[".", "\n"]) + ".\n"
        forks = s.fork(fork_size)
        for i in range(fork_size):
            forks[i] += f"Now, I expand tip {i+1} into a detailed paragraph:\nTip {i+1}:"
            forks[i] += sgl.gen("detailed_tip", max_tokens, stop=["\n\n"])
        forks.join()
        s += "Here are these tips with detailed explanation:\n"
        for i in range(fork_size):
            s += f"Tip {i+1}:" + forks[i]["detailed_tip"] + "\n"
        s += "\nIn summary," + sgl.gen("summary", max_tokens=32)
        return forks

    ret = parallel_decoding.run(topic="writing a good blog post", temperature=0.3)
    tips, forks = ret["detailed_tip"], ret.return_value
    assert isinstance(ret["summary"], str) and len(tips) == fork_size
    assert all(isinstance(t, str) for t in tips)
    for i, branch in enumerate(forks):  # each branch wrote its own tip
        assert branch.text().endswith(f"Tip {i+1}:" + tips[i]) and f"Tip {i+1}:" + tips[i] in ret.text()
    # the skeleton's gens, the fork's commit, the branches' gens, the summary
    assert ret.usage().calls == fork_size + 1 + fork_size + 1


def test_parallel_encoding_with_concate_and_append():
    @sgl.function
    def parallel_encoding(s, question, context_0, context_1, context_2):
        s += "USER: I will ask a question based on some statements.\n"
        s += "ASSISTANT: Sure. I will give the answer.\n"
        s += "USER: Please memorize these statements.\n"
        contexts = [context_0, context_1, context_2]
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Now, please answer the following question. Do not list options."
        s += "\nQuestion: " + question + "\n"
        s += "ASSISTANT:" + sgl.gen("answer", max_tokens=24)

    ret = parallel_encoding.run(
        question="Who is the father of Julian?",
        context_0="Ethan is the father of Liam.",
        context_1="Noah is the father of Julian.",
        context_2="Oliver is the father of Carlos.",
        temperature=0,
    )
    text = ret.text()
    statements = [text.index(f"Statement {i}: ") for i in range(3)]
    assert statements == sorted(statements) and "Now, please answer" in text
    assert isinstance(ret["answer"], str)
    commit, answer = [c for c in ret.calls() if c.kind in ("prefill", "gen")]
    assert answer.cached_tokens >= commit.prompt_tokens - 1  # the fork's prefix stayed cached


def test_streaming_by_variable():
    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        # The regex makes the answer several tokens of text whatever the CPU's rounding: left
        # free, the base model can end at once or spend its tokens on ones that decode to nothing.
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, regex=r"The sea is [a-z]+( [a-z]+)*\."))

    ret = qa(question="Write one sentence about the sea.", stream=True)
    chunks = list(ret.text_iter("answer"))
    assert "".join(chunks) == ret["answer"] and len(chunks) >= 2  # as it was generated

    ret = qa(question="Write one sentence about the sea.", stream=True)
    out = "".join(ret.text_iter())
    assert out == ret.text() and out.endswith(ret["answer"] + "\n")


def test_min_tokens():
    @sgl.function
    def short(s):
        s += "Q: Say yes.\nA:" + sgl.gen("a", min_tokens=10, max_tokens=14)

    ret = short.run(temperature=0)
    assert 10 <= ret.get_meta_info("a")["completion_tokens"] <= 14


def test_num_api_spec_tokens_and_token_usage():
    def character(s):
        s += "Construct a character within the following format:\n"
        s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n"
        s += "\nPlease generate new Name, Birthday and Job.\n"
        s += "Name:" + sgl.gen("name", stop="\n", max_tokens=16) + "\nBirthday:" + \
            sgl.gen("birthday", stop="\n", max_tokens=16)
        s += "\nJob:" + sgl.gen("job", stop="\n", max_tokens=16) + "\n"

    gen_character_spec = sgl.function(num_api_spec_tokens=64)(character)
    gen_character_no_spec = sgl.function(character)

    token_usage = sgl.global_config.default_backend.token_usage
    token_usage.reset()
    spec = gen_character_spec(temperature=0)
    spec.sync()
    usage_with_spec = (token_usage.requests, token_usage.prompt_tokens, token_usage.completion_tokens)
    token_usage.reset()
    plain = gen_character_no_spec(temperature=0)
    usage_no_spec = (token_usage.requests, token_usage.prompt_tokens, token_usage.completion_tokens)
    # stemma's backends keep the prefix in their cache, so speculation changes nothing
    assert spec.vars() == plain.vars() and usage_with_spec == usage_no_spec
    assert token_usage.prompt_tokens > 0 and token_usage.cached_tokens > 0
    assert token_usage.cached_tokens == sum(c.cached_tokens for c in plain.calls())
    token_usage.reset()
    assert (token_usage.prompt_tokens, token_usage.completion_tokens, token_usage.cached_tokens) == (0, 0, 0)


def test_runtime_endpoint(default_backend):
    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")

    endpoint = sgl.RuntimeEndpoint(default_backend.runtime.address)
    here = qa.run(question="What is 2+2?", temperature=0)
    there = qa.run(question="What is 2+2?", temperature=0, backend=endpoint)
    assert there["answer"] == here["answer"] and endpoint.token_usage.requests == 1
    endpoint.close()
