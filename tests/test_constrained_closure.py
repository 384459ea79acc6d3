"""Budget closure: a constrained output closes within its token budget (max_new_tokens and the
context). Fast tests run on the tiny random llama with the ByteLevel test tokenizer (float32): a
random model writes noise and never closes anything by itself, so every output that parses at a
tight budget parses because of the closure. The acceptance run on the default model is marked
slow (it builds 20 Indexes)."""
import json
import re

import jsonschema
import lark
import numpy as np
import pytest

import stemma
from stemma import SamplingParams
from stemma.constrained.closure import UNREACHABLE, RegexClosure, byte_lltokenizer, shortest_bytes
from stemma.constrained.index_cache import IndexCache
from stemma.constrained.json_schema import schema_to_regex
from stemma.constrained.vocab import build_vocab
from tests.bytelevel_tokenizer import build_tiny_bytelevel

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(**props):
    return {"type": "object", "properties": props, "required": list(props)}


def arr(items):
    return {"type": "array", "items": items}


OPEN_SCHEMAS = [obj(name=S, age=I), obj(score=N, tags=arr(S)), obj(user=obj(id=I, login=S), ok=B),
                obj(matrix=arr(arr(I)))]
REGEXES = [r"\d+(\.\d+)?-[a-z]+!", r"\((\d+,)*\d+\)", r"[a-z]+@[a-z]+\.(com|org)"]
GRAMMAR = '''start: value
value: NUMBER | "[" [value ("," value)*] "]" | "(" value OP value ")"
OP: "+" | "*"
NUMBER: /[0-9]+/
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(build_tiny_bytelevel(tmp_path_factory.mktemp("tiny_bytelevel_closure")))


def make(folder, **kw):
    cfg = dict(dtype="float32", kv_pool_tokens=8192, max_running_requests=64, attention_backend="torch")
    return stemma.Engine(folder, **{**cfg, **kw})


@pytest.fixture(scope="module")
def engine(folder):
    return make(folder)


def shortest(engine, params) -> int:
    """d(start) of a regex / schema request, from its (built and cached) closure table."""
    constrainer = engine.scheduler.constrainer
    spec = constrainer.check(params)
    constrainer.start(spec).result()
    table = constrainer.indexes.lookup_closure(spec.source, constrainer.vocab().fingerprint)
    return table.distance(table.initial)


def holds(text: str, params) -> bool:
    try:
        if params.json_schema is not None:
            jsonschema.validate(json.loads(text), json.loads(params.json_schema))
        elif params.regex is not None:
            return re.fullmatch(params.regex, text) is not None
        else:
            lark.Lark(params.grammar).parse(text)
    except Exception:
        return False
    return True


def assert_all_hold(outs, params):
    for out, p in zip(outs, params):
        assert holds(out.text, p), (p.max_new_tokens, out.finish_reason, out.text, out.meta.get("error"))
        assert out.finish_reason in ("stop", "length") and "error" not in out.meta, out.meta
        assert len(out.token_ids) <= p.max_new_tokens


# ---------------------------------------------------------------- the tables


@pytest.fixture(scope="module")
def vocab(folder):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return build_vocab(tok, len(tok) + 3)


@pytest.mark.parametrize("regex", [*REGEXES, schema_to_regex(json.dumps(OPEN_SCHEMAS[1]))])
def test_the_table_holds_shortest_completions_and_restricts_to_them(vocab, regex):
    ends = IndexCache(2).get(regex, vocab)
    table = RegexClosure.build(ends, vocab.eos_token_id)
    eos, index = vocab.eos_token_id, ends.index
    assert ends.end == eos  # marked
    assert table.initial == index.get_initial_state()
    for state in table._states:
        nexts = {t: index.get_next_state(state, t) for t in index.get_allowed_tokens(state) if t != eos}
        d = table.distance(state)
        if ends.accepting(state):
            assert d == 0
        else:  # Bellman: one token, then the best next state
            assert d == 1 + min(table.distance(n) for n in nexts.values()) < UNREACHABLE
        for budget in range(1, d + 4):
            row = np.zeros((vocab.size + 31) // 32, dtype=np.uint32)
            for t in nexts:
                row[t >> 5] |= np.uint32(1 << (t & 31))
            changed = table.restrict(row, state, budget)
            kept = {t for t in range(vocab.size) if row[t >> 5] >> (t & 31) & 1}
            want = {t for t, n in nexts.items() if table.distance(n) <= budget - 1}
            if budget < d:  # too small already: left alone
                assert kept == set(nexts) and not changed
            else:
                assert kept == want and changed == (want != set(nexts))
                if budget == d:  # exactly the shortest paths
                    assert all(table.distance(nexts[t]) == d - 1 for t in kept)


def test_the_grammar_search_finds_closing_bytes():
    from llguidance import LLMatcher
    json_like = r'''start: value
value: object | array | STRING | NUMBER | "true"
object: "{" [pair ("," pair)*] "}"
pair: STRING ":" value
array: "[" [value ("," value)*] "]"
STRING: /"[^"\\]*"/
NUMBER: /[0-9]+/
'''
    cases = [(GRAMMAR, "(((((2*3", b")*0)*0)*0)*0)"), (GRAMMAR, "[[1,(2+", b"0)]]"), (GRAMMAR, "12", b""),
             (json_like, '{"a":[{"b":"hello wor', b'"}]}'), (json_like, '[[[[{"x":', b"0}]]]]"),
             (json_like, '{"a":{"b":{"c":[1,{"d":"x', b'"}]}}}'), (json_like, '{"k":t', b"rue}")]
    for grammar, prefix, completion in cases:
        matcher = LLMatcher(byte_lltokenizer(), LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert matcher.consume_tokens(list(prefix.encode()))
        assert shortest_bytes(matcher) == completion, prefix


# ---------------------------------------------------------------- in the engine


def test_schemas_close_at_every_budget_from_the_shortest_to_three_times_it(engine):
    params = []
    for schema in OPEN_SCHEMAS:
        d0 = shortest(engine, SamplingParams(json_schema=schema))
        for budget in range(d0, 3 * d0 + 1, 2):
            for seed in range(2):
                params.append(SamplingParams(json_schema=schema, max_new_tokens=budget,
                                             temperature=1.0, seed=seed))
    outs = engine.generate([[5 + i % 7, 30, 31] for i in range(len(params))], params)
    assert_all_hold(outs, params)
    assert all(o.finish_reason == "stop" for o in outs)  # an object's last brace ends it
    assert engine.scheduler.constrainer.stats.closed_requests > len(params) // 2
    engine.check_pool_whole()


def test_without_closure_the_same_requests_run_out(folder):
    engine = make(folder, constraint_budget_closure=False)
    schema = OPEN_SCHEMAS[0]
    d0 = shortest(make(folder), SamplingParams(json_schema=schema))
    params = [SamplingParams(json_schema=schema, max_new_tokens=d0 + k, temperature=1.0, seed=k)
              for k in range(8)]
    outs = engine.generate([[5, 30, 31]] * len(params), params)
    assert sum(not holds(o.text, p) for o, p in zip(outs, params)) >= 4
    assert engine.scheduler.constrainer.stats.closed_rows == 0


def test_regexes_and_a_grammar_close(engine):
    params = []
    for regex in REGEXES:
        d0 = shortest(engine, SamplingParams(regex=regex))
        params += [SamplingParams(regex=regex, max_new_tokens=b, temperature=1.0, seed=b)
                   for b in range(d0, 3 * d0 + 1)]
    for logprobs in (False, True):  # logprob requests keep every sampled token: plan followed early
        params += [SamplingParams(grammar=GRAMMAR, max_new_tokens=b, temperature=1.0, seed=b,
                                  logprobs=logprobs) for b in range(1, 16)]
    outs = engine.generate([[6, 40, 41]] * len(params), params)
    assert_all_hold(outs, params)
    for out, p in zip(outs, params):
        if p.logprobs:
            assert len(out.logprobs) == len(out.token_ids)


def test_closure_changes_nothing_before_it_starts(folder):
    """Budgets with room: the same tokens as with closure off, up to where closure first acted."""
    on_engine = make(folder)
    params = []
    for k, schema in enumerate(OPEN_SCHEMAS):
        d0 = shortest(on_engine, SamplingParams(json_schema=schema))
        params += [SamplingParams(json_schema=schema, max_new_tokens=m, temperature=1.0, seed=k * 10 + m)
                   for m in (d0 + 6, 2 * d0, 4 * d0)]
    params += [SamplingParams(grammar=GRAMMAR, max_new_tokens=m, temperature=1.0, seed=m) for m in (12, 24)]
    prompts = [[7, 50 + i, 51] for i in range(len(params))]
    on = on_engine.generate(prompts, params)
    off = make(folder, constraint_budget_closure=False).generate(prompts, params)
    starts = on_engine.scheduler.constrainer.closure_starts
    assert 0 < len(starts) < len(params)  # some needed closure, some did not
    for a, b in zip(on, off):
        start = starts.get(a.rid)
        if start is None:
            assert a.token_ids == b.token_ids
        else:
            assert a.token_ids[:start] == b.token_ids[:start]
    assert any(a.token_ids != b.token_ids for a, b in zip(on, off))
    assert_all_hold(on, params)


def test_a_budget_too_small_for_any_output_ends_length_and_says_so(folder, engine):
    schema = OPEN_SCHEMAS[2]
    d0 = shortest(engine, SamplingParams(json_schema=schema))
    out = engine.generate([5, 6], SamplingParams(json_schema=schema, max_new_tokens=d0 - 1, temperature=0))
    assert out.finish_reason == "length" and len(out.token_ids) == d0 - 1
    message = f"shortest complete output ({d0} tokens) is longer than the {d0 - 1} tokens left"
    assert message in out.meta["error"]
    off = make(folder, constraint_budget_closure=False)
    out = off.generate([5, 6], SamplingParams(json_schema=schema, max_new_tokens=d0 - 1, temperature=0))
    assert out.finish_reason == "length" and "error" not in out.meta


def test_the_context_bounds_the_budget_too(folder):
    schema = OPEN_SCHEMAS[1]
    prompt = [5] * 20
    d0 = shortest(make(folder), SamplingParams(json_schema=schema))
    for room in (0, 3, 9):
        engine = make(folder, max_context=len(prompt) + d0 + room)
        out = engine.generate(prompt, SamplingParams(json_schema=schema, max_new_tokens=500,
                                                     temperature=1.0, seed=room))
        assert holds(out.text, SamplingParams(json_schema=schema)), (room, out.text)
        assert len(out.token_ids) <= d0 + room


def test_jump_forward_tokens_count_against_the_budget(folder):
    """Forced text tokenized byte by byte takes more tokens than the shortest path: the jumps
    that would overrun the budget are not taken, and the outputs still close."""
    engine = make(folder)
    constrainer = engine.scheduler.constrainer
    vocab = constrainer.vocab()
    constrainer.encode = lambda text: [vocab.byte_token_ids[b] for b in text.encode("utf-8")]
    schema = obj(first_name=S, favourite_number=I, is_registered=B)
    d0 = shortest(engine, SamplingParams(json_schema=schema))
    params = [SamplingParams(json_schema=schema, max_new_tokens=d0 + k, temperature=1.0, seed=k)
              for k in range(12)]
    outs = engine.generate([[5, 30, 31]] * len(params), params)
    assert_all_hold(outs, params)
    assert constrainer.stats.refused_jumps > 0 and constrainer.stats.jumps > 0
    engine.check_pool_whole()


# ---------------------------------------------------------------- the default model (slow)

DEFAULT_SCHEMAS = [
    obj(name=S, age=I), obj(title=S, year=I, rating=N), obj(id=I, tags=arr(S)),
    obj(city=S, population=I, area=N), obj(scores=arr(I)), obj(values=arr(N), label=S),
    obj(user=obj(id=I, login=S), active=B), obj(product=S, price=N, stock=I), obj(lat=N, lon=N),
    obj(words=arr(S), count=I), obj(a=I, b=I, c=I), obj(name=S, friends=arr(obj(name=S, age=I))),
    obj(matrix=arr(arr(I))), obj(event=S, date=S, attendees=I),
    obj(temperature=N, unit={"enum": ["C", "F"]}), obj(isbn=S, pages=I, authors=arr(S)), obj(x=N, y=N, z=N),
    obj(order_id=I, items=arr(obj(sku=S, qty=I)), total=N),
    obj(country=S, capital=S, languages=arr(S), gdp=N), obj(team=S, wins=I, losses=I, ratio=N),
]
DEFAULT_KINDS = ["person", "film", "record", "city", "exam", "measurement", "account", "product", "place",
                 "text", "triple", "person", "grid", "event", "weather report", "book", "point", "order",
                 "country", "sports team"]
DEFAULT_REGEXES = {
    "A list of the first prime numbers: ": r"\((\d+, )*\d+\)",
    'His favourite quote was "': r'[A-Za-z ,]+"\.',
    "The parcel weighs ": r"\d+\.\d+ (kg|lb)",
    "Pi to many digits: ": r"3\.\d+!",
}
DEFAULT_GRAMMAR = '''start: "Result: " expr " = " NUMBER "."
expr: term (ADD term)*
term: factor (MUL factor)*
factor: NUMBER | "(" expr ")"
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[0-9]+/
'''


@pytest.mark.slow
def test_default_model_outputs_close_within_their_budgets():
    """Greedy, float32 (batch-invariant, so runs with closure on and off can be compared token by
    token): 20 schemas with unbounded integers, numbers, strings and arrays, regexes and a Lark
    grammar, each at budgets from its shortest output to three times it, all hold; with room to
    spare, closure changes nothing before it starts. About two minutes on two cores, most of it
    building the 24 Indexes."""
    # speculation off: its verify rows sit in wider forwards, which can flip a float32 near-tie
    engine = stemma.Engine(dtype="float32", max_running_requests=128, speculative="none")
    constrainer = engine.scheduler.constrainer
    schema_params = [SamplingParams(json_schema=s, temperature=0) for s in DEFAULT_SCHEMAS]
    d0 = [shortest(engine, p) for p in schema_params]
    prompts = [f"A JSON record describing a {k}:\n" for k in DEFAULT_KINDS]
    spread = [(p, d, i) for i, (p, d) in enumerate(zip(schema_params, d0))]
    tight = [p.replace(max_new_tokens=d + round(2 * d * i / 19)) for p, d, i in spread]
    tight += [p.replace(max_new_tokens=d + round(2 * d * (19 - i) / 19)) for p, d, i in spread]
    regex_prompts, regex_params = [], []
    for prompt, regex in DEFAULT_REGEXES.items():
        d = shortest(engine, SamplingParams(regex=regex))
        for budget in range(d, 3 * d + 1):
            regex_prompts.append(prompt)
            regex_params.append(SamplingParams(regex=regex, temperature=0, max_new_tokens=budget))
    grammar_guide = constrainer.start(constrainer.check(SamplingParams(grammar=DEFAULT_GRAMMAR))).result()()
    g0 = grammar_guide.shortest()
    assert g0 is not None and g0 > 3
    grammar_params = [SamplingParams(grammar=DEFAULT_GRAMMAR, temperature=0, max_new_tokens=b)
                      for b in range(g0, 3 * g0 + 1)]
    grammar_prompts = ["Compute step by step. " + "(" * (b % 4) for b in range(len(grammar_params))]
    all_prompts = prompts * 2 + regex_prompts + grammar_prompts
    all_params = tight + regex_params + grammar_params
    outs = engine.generate(all_prompts, all_params)
    assert_all_hold(outs, all_params)
    assert constrainer.stats.closed_requests >= len(all_params) // 3

    # room to spare: the same tokens as without closure up to where closure started
    roomy = [p.replace(max_new_tokens=m) for p, d in zip(schema_params, d0) for m in (3 * d, 96)]
    roomy_prompts = [p for p in prompts for _ in range(2)]
    before = dict(constrainer.closure_starts)
    on = engine.generate(roomy_prompts, roomy)
    constrainer.budget_closure = False
    try:
        off = engine.generate(roomy_prompts, roomy)
    finally:
        constrainer.budget_closure = True
    assert_all_hold(on, roomy)
    starts = {rid: at for rid, at in constrainer.closure_starts.items() if rid not in before}
    assert 0 < len(starts) < len(roomy)
    assert sum(not holds(o.text, p) for o, p in zip(off, roomy)) > 0  # without closure some run out
    for a, b in zip(on, off):
        start = starts.get(a.rid)
        if start is None:
            assert a.token_ids == b.token_ids
        else:
            assert a.token_ids[:start] == b.token_ids[:start]
    engine.check_pool_whole()
    print(f"\nclosure on the default model: {constrainer.stats}")


def test_a_grammar_far_from_its_budget_searches_only_now_and_then(folder, vocab):
    from transformers import AutoTokenizer

    from stemma.constrained.closure import GrammarClosure
    from stemma.constrained.grammar import REFRESH, GrammarGuide, build_lltokenizer
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    guide = GrammarGuide(build_lltokenizer(vocab, encode, None), GRAMMAR, GrammarClosure(vocab))
    guide.budget = 1000
    row = np.zeros((vocab.size + 31) // 32, dtype=np.uint32)
    for token in encode("[" + "1," * 99 + "2"):
        guide.fill_mask(row.ctypes.data, len(row))
        assert not guide.restrict(row)
        assert guide.accept(token) and guide.after_accept(token, guide.budget - 1) is None
        guide.budget -= 1
    assert guide._search.searches <= 2 + 200 // REFRESH
    (close,) = encode("]")
    guide.budget = 2  # room for `]` and one more: free, but a `,` would leave no room to close
    guide.fill_mask(row.ctypes.data, len(row))
    assert not guide.restrict(row)
    (comma,) = encode(",")
    assert guide.accept(comma) and guide.after_accept(comma, 1) == close
    guide.budget = 1  # and now only the plan's `]` is left
    assert guide.rollback(1) is None and guide.accept(encode("2")[0])
    guide.fill_mask(row.ctypes.data, len(row))
    assert guide.restrict(row)
    assert [t for t in range(vocab.size) if row[t >> 5] >> (t & 31) & 1] == [close]
