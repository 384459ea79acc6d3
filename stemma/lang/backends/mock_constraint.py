"""Constrained output for the mock backend: deterministic text that fullmatches a regex (or a
JSON schema's regex, made and checked by the engine's stemma.constrained.spec), walked through an
end-marked outlines-core Index (stemma.constrained.end_mark), as the engine's constraints are.

The mock's tokens are characters (id = code point), so its vocabulary here is one token per
character: printable ASCII, tab and newline, and every other character the pattern names. At
each step the walk takes the character the unconstrained reply has there when the pattern
allows it, else one picked by a generator seeded with the prompt; it stops in an accepting
state by the same generator's draw, and never takes a step that cannot still reach one within
the token budget (each state's shortest distance to acceptance, computed once per pattern).
A reply (MockBackend(reply=...)) that already fullmatches the pattern is kept as it is.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from stemma.sampling_params import SamplingParams

EOS = 0  # the Index's end token; not a character the mock ever emits
STAND_IN = 0x110000  # the marked Index's stand-in EOS: past every code point
_BASE = "\t\n" + "".join(chr(c) for c in range(32, 127))
STOP_CHANCE = 0.25  # in an accepting state that may go on, how often the walk ends there


def pattern_of(params: SamplingParams) -> str | None:
    """The regex a request's output must fullmatch: its regex, or its JSON schema's, made and
    checked as the engine does (a constraint the engine refuses is refused here, with its
    message); None when unconstrained. A grammar is refused: the mock has no Lark engine."""
    if params.grammar is not None:
        raise ValueError("MockBackend runs regex, dtype and json_schema constraints (outlines-core), "
                         "not grammars; test a grammar program on a model backend")
    from stemma.constrained.spec import check
    spec = check(params)
    return None if spec is None else spec.source


@dataclass(frozen=True)
class _Automaton:
    initial: int
    finals: frozenset[int]
    moves: dict[int, dict[int, int]]   # state -> {character id: next state}, EOS left out
    distance: dict[int, int]           # state -> fewest characters to an accepting state


@lru_cache(maxsize=64)
def _automaton(pattern: str) -> _Automaton:
    from outlines_core import Vocabulary

    from stemma.constrained import end_mark
    chars = sorted(set(_BASE) | {c for c in pattern if ord(c) > 126})
    text = {c.encode(): [ord(c)] for c in chars}
    try:  # marked: outlines-core keeps every way on from where the pattern may end
        ends = end_mark.build(pattern, end_mark.marked_vocabulary(text, EOS, STAND_IN),
                              lambda: Vocabulary(EOS, text), EOS)
    except Exception as exc:  # outlines-core's own error types: a pattern it cannot compile
        raise ValueError(f"regex {pattern!r}: {exc}") from None
    index = ends.index
    moves = {state: {t: nxt for t, nxt in out.items() if t not in (EOS, STAND_IN)}
             for state, out in index.get_transitions().items()}
    finals = frozenset(s for s in moves if ends.accepting(s))
    return _Automaton(index.get_initial_state(), finals, moves, _distances(moves, finals))


def _distances(moves: dict[int, dict[int, int]], finals: frozenset[int]) -> dict[int, int]:
    """Breadth-first from the accepting states over the reversed moves."""
    back: dict[int, set[int]] = {}
    for state, out in moves.items():
        for nxt in out.values():
            back.setdefault(nxt, set()).add(state)
    distance = {s: 0 for s in finals}
    queue = deque(finals)
    while queue:
        state = queue.popleft()
        for prev in back.get(state, ()):
            if prev not in distance:
                distance[prev] = distance[state] + 1
                queue.append(prev)
    return distance


def constrained_text(pattern: str, ids: Sequence[int], limit: int, prefer: str) -> tuple[str, bool]:
    """(text, complete): at most `limit` characters that fullmatch `pattern` when `complete`;
    when no match fits the budget, the start of the shortest one, and complete is False."""
    if len(prefer) <= limit and _fullmatches(pattern, prefer):  # a reply that already fits is kept
        return prefer, True
    auto = _automaton(pattern)
    rng = random.Random(int.from_bytes(hashlib.sha256(repr(list(ids)).encode()).digest()[:8], "big"))
    state, out = auto.initial, []
    if auto.distance.get(state, limit + 1) > limit:
        return _shortest(auto, limit), False
    while True:
        left = limit - len(out)
        steps = sorted(t for t, nxt in auto.moves.get(state, {}).items()
                       if auto.distance.get(nxt, left) <= left - 1)
        if state in auto.finals and (not steps or rng.random() < STOP_CHANCE):
            return "".join(out), True
        want = ord(prefer[len(out)]) if len(out) < len(prefer) else None
        token = want if want in steps else steps[rng.randrange(len(steps))]
        out.append(chr(token))
        state = auto.moves[state][token]


def _fullmatches(pattern: str, text: str) -> bool:
    """Whether Python's re fullmatches `text` (False for a pattern only outlines-core reads)."""
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False


def _shortest(auto: _Automaton, limit: int) -> str:
    """The first `limit` characters of a shortest accepted text (empty if none is reachable)."""
    state, out = auto.initial, []
    while len(out) < limit and state in auto.distance and auto.distance[state] > 0:
        token = min(t for t, nxt in auto.moves[state].items()
                    if auto.distance.get(nxt, -1) == auto.distance[state] - 1)
        out.append(chr(token))
        state = auto.moves[state][token]
    return "".join(out)
