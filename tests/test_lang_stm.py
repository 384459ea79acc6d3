"""Text programs: the grammar, what it compiles to, its errors (with line and column), and
`stemma run`, on the mock backend."""
import pytest

import stemma
from stemma.cli import main
from stemma.lang.backends.mock import MockBackend
from stemma.lang.ir import Gen, RoleBegin, RoleEnd, Select, Text, VarRef, Where
from stemma.lang.stm import StmSyntaxError, compile_nodes

PROGRAM = '''\
{system}You are terse.{/system}
{user}
Question: {question}
{/user}
{assistant}{gen answer max_tokens=16 stop="\\n" temperature=0.5}{/assistant}
Right? {select verdict choices=["yes", 'no way'] method="greedy_token"} {{braces}}
Again: {answer}
'''


def test_compiles_to_the_ir():
    assert compile_nodes(PROGRAM, "p.stm") == (
        RoleBegin("system"), Text("You are terse."), RoleEnd("system"),
        RoleBegin("user"), Text("Question: "), VarRef("question", Where(3, 11, "p.stm")), RoleEnd("user"),
        RoleBegin("assistant"),
        Gen("answer", (("max_new_tokens", 16), ("stop", ("\n",)), ("temperature", 0.5))),
        RoleEnd("assistant"),
        Text("Right? "), Select("verdict", ("yes", "no way"), "greedy_token"),
        Text(" {braces}\nAgain: "), VarRef("answer", Where(7, 8, "p.stm")), Text("\n"))
    assert stemma.compile_text(PROGRAM).arguments == {"question": Where(3, 11, "<text>")}


def test_escapes_of_names_are_text_and_an_option_is_given_once(tmp_path):
    """\\N{name} is read as Python reads it (its braces were a hole); an option given under
    SGLang's name and stemma's is an error (the second silently won); an editor's BOM is not
    text."""
    assert compile_nodes("20\\N{DEGREE SIGN}C {gen t}", "t") == (Text("20\u00b0C "), Gen("t", ()))
    assert compile_nodes("a\\{b}", "t") == (Text("a\\"), VarRef("b", Where(1, 3, "t")))  # as before
    with pytest.raises(StmSyntaxError, match="max_tokens and max_new_tokens are the same option"):
        compile_nodes("{gen x max_tokens=2 max_new_tokens=3}", "t")
    path = tmp_path / "bom.stm"
    path.write_bytes("\ufeffHello {gen x}".encode("utf-8"))
    from stemma.lang.stm import load
    assert load(path).nodes[0] == Text("Hello ")


@pytest.mark.parametrize("source, value", [
    ("{gen x stop=['a', \"b\\tc\"]}", ("a", "b\tc")),
    ("{gen x stop=[ ]}", ()),
    ("{gen x  stop = [ 'a' , 'b' , ] }", ("a", "b")),
    ("{gen x seed=7 top_p=0.5e0 ignore_eos=true}", None),
])
def test_values(source, value):
    (node,) = compile_nodes(source)
    params = dict(node.params)
    if value is not None:
        assert tuple(params["stop"]) == value
    else:
        assert params == {"seed": 7, "top_p": 0.5, "ignore_eos": True}


@pytest.mark.parametrize("source, where, message", [
    ("hello }", (1, 7), "write }} for a literal brace"),
    ("line one\nQ: {gen a", (2, 4), "never closed"),  # where the hole opens
    ("a\n  {gen x max_tokns=3}", (2, 3), "unknown SamplingParams fields: max_tokns"),
    ("{select v}", (1, 1), "needs choices"),
    ("{select v choices=['a'] weight=2}", (1, 1), "unknown option 'weight'"),
    ("{gen a b}", (1, 1), "one variable name"),
    ("{gen user}", (1, 1), "'user' is a keyword ({user} opens a block)"),
    ("{select gen choices=['a']}", (1, 1), "'gen' is a keyword"),
    ("{q 3}", (1, 4), "unexpected '3'"),
    ("x\n{user}hi", (2, 1), "{user} block is never closed"),
    ("{/assistant}", (1, 1), "closes no open {assistant} block"),
    ("{user}{assistant}", (1, 7), "inside the {user} block opened at <text>:1:1"),
    ("{/foo}", (1, 1), "closes no block"),
    ("{user x}{/user}", (1, 1), "takes no arguments"),
    ("{gen a stop=[1]}", (1, 1), "stop must hold non-empty strings"),
    # an argument passes to run() by name: one that run() takes for itself could never be given
    ("Q: {temperature}{gen a}", (1, 4), "run() takes 'temperature' for itself (a sampling option)"),
    ("x\n {stream}", (2, 2), "run() takes 'stream' for itself (reserved)"),
])
def test_syntax_errors_report_line_and_column(source, where, message):
    with pytest.raises(stemma.StmSyntaxError) as info:
        stemma.compile_text(source)
    assert (info.value.where.line, info.value.where.column) == where
    assert f"<text>:{where[0]}:{where[1]}: " in str(info.value)
    assert message in str(info.value)


def test_role_tags_on_their_own_lines_drop_their_newlines():
    state = stemma.compile_text("{user}\nHi\n{/user}\n{assistant}\n{gen r max_tokens=3}\n{/assistant}\n") \
        .run(backend=MockBackend())
    assert state.messages()[0] == {"role": "user", "content": "Hi"}
    assert state.text() == f"User: Hi\nAssistant: {state['r']}\n"


def test_unknown_variable_and_extra_variable():
    program = stemma.compile_text("a\nb {question} {answer}{gen answer}", "p.stm")
    with pytest.raises(stemma.UnknownVariable, match=r"p.stm:2:3: unknown variable \{question\}"):
        program.run(backend=MockBackend())
    with pytest.raises(stemma.UnknownVariable, match=r"p.stm:2:14: unknown variable \{answer\}"):
        program.run(question="q", backend=MockBackend())
    with pytest.raises(TypeError, match="has no variable 'qestion'"):
        stemma.compile_text("{question}{gen a}").run(question="q", qestion="x", backend=MockBackend())


def test_a_variable_read_after_the_program_generates_it_is_what_it_generated():
    """{x} before {gen x} is the argument; after it, the generated value (as s["x"] in Python)."""
    state = stemma.compile_text("Q: {x}\nA:{gen x max_tokens=4}\nAgain: {x}").run(x="ARG", backend=MockBackend())
    assert state["x"] != "ARG" and state.text() == f"Q: ARG\nA:{state['x']}\nAgain: {state['x']}"
    stemma.compile_text("{gen temperature} {temperature}")  # generated only: never passed to run()


def test_text_and_python_programs_run_the_same_calls():
    mock_a, mock_b = MockBackend(), MockBackend()
    text = stemma.compile_text(PROGRAM).run(question="why?", backend=mock_a)

    @stemma.function
    def python(s, question):
        s += stemma.system("You are terse.")
        s += stemma.user("Question: " + question)
        s += stemma.assistant(stemma.gen("answer", max_new_tokens=16, stop="\n", temperature=0.5))
        s += "Right? " + stemma.select("verdict", ["yes", "no way"], method="greedy_token")
        s += " {braces}\nAgain: " + s["answer"] + "\n"

    py = python.run(question="why?", backend=mock_b)
    assert text.text() == py.text() and text.vars() == py.vars()
    assert [c.ids for c in mock_a.calls] == [c.ids for c in mock_b.calls]


def test_text_programs_trace_their_constant_prefix():
    trace = stemma.compile_text("Shots: a b c\n{user}Q: {q}{/user}").trace()
    assert trace.render(MockBackend().chat_template) == "Shots: a b c\nUser: Q: "


def test_stemma_run(tmp_path, capsys):
    path = tmp_path / "p.stm"
    path.write_text(PROGRAM)
    assert main(["run", str(path), "--var", "question=why?", "--backend", "mock"]) == 0
    out, err = capsys.readouterr()
    expected = stemma.compile_text(PROGRAM).run(question="why?", backend=MockBackend(),
                                                sampling={"max_new_tokens": 64, "temperature": 0})
    assert out == expected.text()
    assert f"[answer] {expected['answer']!r}" in err and "model calls" in err
    assert main(["run", str(path), "--backend", "mock"]) == 2
    assert f"{path}:3:11: unknown variable {{question}}" in capsys.readouterr().err
    path.write_text("oops {gen a")
    assert main(["run", str(path), "--backend", "mock"]) == 2
    assert f"{path}:1:6: this '{{' is never closed" in capsys.readouterr().err  # where it opens


def test_stemma_run_reports_a_server_s_refusal_on_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    """A server's refusal (a ServerError: the prompt past --max-prompt-tokens, a wrong API key)
    was a traceback, and its message was glued to the partial output."""
    import stemma.cli
    from stemma.client.core import ServerError
    from stemma.lang.backends.mock import MockBackend

    class Refusing(MockBackend):
        async def generate(self, ids, params, on_text=None):
            raise ServerError("bad_request", "the prompt's length in tokens is 4, more than max_prompt_tokens (3)")

    program = tmp_path / "qa.stm"
    program.write_text("Q: {question}\nA:{gen answer}")
    monkeypatch.setattr(stemma.cli, "_backend", lambda ns: Refusing())
    assert stemma.cli.main(["run", str(program), "--var", "question=hi"]) == 1
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "Traceback" not in err
    assert err.startswith("stemma: error: bad_request: the prompt's length")


def test_run_and_repl_reach_a_server_that_wants_a_key(monkeypatch):
    """--connect had no way to give the key of a server started with --api-key."""
    import stemma.cli
    from stemma.cli import build_parser
    ns = build_parser().parse_args(["run", "p.stm", "--connect", "tcp://127.0.0.1:1", "--api-key", "k1"])
    backend = stemma.cli._backend(ns)
    assert backend.client._key == b"k1"
    backend.close()
    monkeypatch.setenv("STEMMA_API_KEY", "k2")
    ns = build_parser().parse_args(["repl", "--connect", "tcp://127.0.0.1:1"])
    backend = stemma.cli._backend(ns)
    assert backend.client._key == b"k2"
    backend.close()
