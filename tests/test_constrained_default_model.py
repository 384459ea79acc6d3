"""Acceptance on the default model (Gemma 3 270M): 50 JSON-schema requests, regexes and a grammar
run in one continuous batch with 50 plain requests. Every constrained output holds; the plain ones
are token-identical to a run without the constrained ones.

float32: the CPU's bf16 matmuls are not batch-invariant (about 1 in 20 greedy continuations flips a
near-tie when the batch changes, constraints or not), and the identity check is about the masks,
not the matmuls. About 100 s on two cores, a quarter of it building the 12 Indexes.
"""
import json
import re
import time

import jsonschema
import lark
import pytest

import stemma
from stemma import SamplingParams

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "hiking", "music", "cooking"]},
                    "maxItems": 3}},
     "required": ["name", "age", "hobbies"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "login": {"type": "string", "minLength": 2, "maxLength": 12}}, "required": ["id", "login"]},
        "active": {"type": "boolean"},
        "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]},
                  "minItems": 1, "maxItems": 2}},
     "required": ["user", "active", "roles"]},
    {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
        "price": {"type": "integer", "minimum": 1, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "stock": {"type": "object", "properties": {
            "warehouse": {"enum": ["north", "south"]},
            "count": {"type": "integer", "minimum": 0, "exclusiveMaximum": 500}},
            "required": ["warehouse", "count"]}},
     "required": ["sku", "price", "tags", "stock"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "date": {"type": "string", "format": "date"},
        "priority": {"enum": ["low", "medium", "high"]},
        "attendees": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["title", "date", "priority", "attendees"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "coords": {"type": "object", "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
        "capital": {"type": "boolean"}},
     "required": ["city", "coords", "population", "capital"]},
]
SUBJECTS = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jules"]
REGEXES = {
    "The date of the moon landing, as YYYY-MM-DD:": r"\d{4}-\d{2}-\d{2}",
    "Today's date in ISO format:": r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "Call us at": r"\(\d{3}\) \d{3}-\d{4}",
    "Phone:": r"\+1 \d{3}-\d{3}-\d{4}",
    "Is the sky blue? Answer:": r" ?(yes|no|maybe)",
    "The best pet is the": r" (cat|dog|parrot|goldfish)",
    "The number pi is about": r" \d(\.\d{1,4})?",
}
GRAMMAR = '''start: expr
expr: term (ADD term)~0..3
term: factor (MUL factor)~0..2
factor: NUMBER | "(" NUMBER ADD NUMBER ")"
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[1-9][0-9]{0,2}/
'''
PLAIN = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


def json_prompt(schema_index: int, subject: str) -> str:
    kinds = ["person", "user account", "product", "event", "city"]
    return f"A JSON record describing the {kinds[schema_index]} '{subject}':\n"


def plain_prompts() -> list[str]:
    topics = ["the sea", "a library", "winter", "bread", "trains", "a violin", "the moon", "bees",
              "a garden", "rain"]
    return [f"{style} about {topic}:" for style in ("A short story", "A poem", "Three facts",
                                                     "A letter", "A recipe idea") for topic in topics]


@pytest.fixture(scope="module")
def engine():
    return stemma.Engine(dtype="float32", max_running_requests=128)


def test_fifty_schemas_beside_fifty_plain_requests(engine):
    t0 = time.perf_counter()
    alone = [o.token_ids for o in engine.generate(plain_prompts(), PLAIN)]
    assert engine.flush_cache()  # the mixed run starts from the same (empty) cache
    bad = [({"regex": "[0-9"}, "^regex: .*unclosed character class"),
           ({"json_schema": {"type": "object", "properties": {"a": {"type": "numbr"}}}},
            "^json_schema is invalid at /properties/a/type"),
           ({"json_schema": {"type": "array", "uniqueItems": True}}, "^json_schema keyword 'uniqueItems'"),
           ({"grammar": "start: expr"}, '^grammar is invalid: .*unknown name: "expr"')]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.submit("x", SamplingParams(**fields))
    schema_params = [SamplingParams(json_schema=SCHEMAS[i % 5], temperature=0, max_new_tokens=192)
                     for i in range(50)]
    regex_params = [SamplingParams(regex=rx, temperature=0, max_new_tokens=32) for rx in REGEXES.values()]
    grammar_params = [SamplingParams(grammar=GRAMMAR, temperature=0, max_new_tokens=48),
                      SamplingParams(grammar=GRAMMAR, temperature=0.8, seed=5, max_new_tokens=48)]
    # Build every Index first (they are cached), so that all constrained requests enter the batch
    # at once, beside the plain ones; the grammar queue itself is covered by the tiny-model tests.
    constrainer = engine.scheduler.constrainer
    t_build = time.perf_counter()
    for params in schema_params[:5] + regex_params + grammar_params[:1]:
        constrainer.start(constrainer.check(params)).result()
    t_build = time.perf_counter() - t_build
    schema_reqs, regex_reqs, plain_reqs = [], [], []
    plain = plain_prompts()
    for i in range(50):
        schema_reqs += engine.submit(json_prompt(i % 5, SUBJECTS[i // 5]), schema_params[i])
        plain_reqs += engine.submit(plain[i], PLAIN)
    for prompt, params in zip(REGEXES, regex_params):
        regex_reqs += engine.submit(prompt, params)
    grammar_reqs = engine.submit("An arithmetic expression with parentheses: ", grammar_params[0])
    grammar_reqs += engine.submit("Compute ", grammar_params[1])
    everything = schema_reqs + regex_reqs + grammar_reqs + plain_reqs
    together = 0
    while not all(r.finished for r in everything):
        if not engine.step():
            time.sleep(0.001)
        running = engine.scheduler.running
        guided = sum(r.constraint is not None for r in running)
        together = max(together, min(guided, len(running) - guided))
    assert together >= 45  # constrained and plain rows shared the batch
    for req in schema_reqs:
        out = engine.output(req)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[schema_reqs.index(req) % 5])
    for req, rx in zip(regex_reqs, REGEXES.values()):
        out = engine.output(req)
        assert out.finish_reason == "stop" and re.fullmatch(rx, out.text), (rx, out.text)
    pi = engine.output(regex_reqs[-1]).text
    assert re.fullmatch(r" 3\.14\d\d", pi), pi  # outlines-core's own Index refused "." after " 3"
    parser = lark.Lark(GRAMMAR)
    for req in grammar_reqs:
        out = engine.output(req)
        assert out.finish_reason == "stop", out.text
        parser.parse(out.text)
    assert [engine.output(r).token_ids for r in plain_reqs] == alone
    stats = engine.scheduler.constrainer.stats
    assert stats.jumps > 0 and stats.forced_tokens > 0
    engine.check_pool_whole()
    still = engine.generate("The capital of France is", SamplingParams(regex=" [A-Z][a-z]+", max_new_tokens=8))
    assert re.fullmatch(" [A-Z][a-z]+", still.text)
    print(f"\nacceptance run: {time.perf_counter() - t0:.0f}s ({t_build:.0f}s building "
          f"{constrainer.indexes.builds} Indexes), {engine.stats()['steps']} steps, {stats}")
