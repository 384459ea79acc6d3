"""Constrained decoding: output that fullmatches a regex, validates against a JSON schema, or parses
under a Lark-syntax grammar.

    submission   spec.check(params)            fast checks; a bad pattern is a ValueError here
                 Constrainer.start(req)        Index / grammar build on a background thread
    grammar queue                              the request waits outside the batch until built
    built        Constrainer.attach(req)       the guide, with the request's token budget
    each step    bitmask.fill + bitmask.apply  one int32 bitmask for the constrained rows only,
                 (+ closure)                   narrowed to what can still close within the budget
    after sample Constrainer.advance           accept the token; jump_forward.plan appends forced
                                               tokens, retokenized at the boundary

Files: vocab (token id -> bytes), int_range, json_pattern and json_schema (schema -> regex), spec
(what a request asks for, checked), end_mark (outlines-core Indexes that keep every way on where
the regex may end), index_cache (their cache), guide (regex guide), grammar (llguidance guide),
closure (budget closure: shortest completions), bitmask, jump_forward, constrainer (what the
scheduler calls).
"""
