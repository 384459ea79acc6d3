"""An outlines-core Index that keeps every way on from a state where its regex may end.

outlines-core 0.2.14 (the latest) keeps, from a state where the regex may end (a final state), only
the token transitions that end in another final state, and drops the tokens whose bytes pass
through one on the way: `a|abc` never writes `abc`, not even as the one token "abc", and a JSON
`number` after `0` takes a fraction only from tokens such as `.5`, never from `.` then `5`.
Outputs still match; the regex's language is cut short.

The way round: the Index is built for `(?:R)\\x00` over the vocabulary less the tokens that hold a
NUL byte, with the NUL itself given the id of the real EOS token, and a stand-in EOS id past the
vocabulary. No state of R is final for outlines-core, so none of R's transitions is dropped, and R
may end in a state exactly where the EOS id (the NUL) leads to a final state. No text token holds a
NUL, so the final states are reached through the EOS id alone, which a guide never accepts (an end
token ends the request): the stand-in is never written into a mask.

The cost: a constrained output never writes a NUL. A regex that could reach a state from which
every way to an end writes one (`a+\\x00`), that cannot be built so (`a$`, or an `(?x)` comment
at its end, which swallows the mark), or that is too large to check (MAX_WALK) gets the plain
Index, cut short as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from outlines_core import Index, Vocabulary

MARK = b"\x00"
MAX_WALK = 100_000  # byte transitions marks_cleanly walks at most (about 0.15 s of GIL)
_BYTE_END = 0  # the mark's id in the byte vocabulary marks_cleanly walks


@dataclass(frozen=True, eq=False)
class EndIndex:
    index: Index
    end: int | None  # the id the mark takes (the real EOS); None: the plain Index

    def accepting(self, state: int) -> bool:
        """Whether the regex may end in `state`."""
        if self.end is None:
            return self.index.is_final_state(state)
        after = self.index.get_next_state(state, self.end)
        return after is not None and self.index.is_final_state(after)


def marked_vocabulary(text_map: dict[bytes, list[int]], eos: int, stand_in: int) -> Vocabulary:
    """outlines-core's Vocabulary for a marked Index: the text tokens without a NUL, the mark as
    `eos`, and `stand_in` (an id no token has) as its EOS."""
    from outlines_core import Vocabulary
    kept = {piece: ids for piece, ids in text_map.items() if MARK not in piece}
    kept[MARK] = [eos]
    return Vocabulary(stand_in, kept)


def build(regex: str, marked: Vocabulary, plain: Callable[[], Vocabulary], eos: int) -> EndIndex:
    """The EndIndex of `regex`: marked (`marked` from marked_vocabulary with `eos`) where that
    leaves no dead end and builds, else plain (`plain()` gives the Vocabulary of the text tokens
    under `eos`)."""
    from outlines_core import Index
    if marks_cleanly(regex):
        try:
            return EndIndex(Index(f"(?:{regex})\\x00", marked), eos)
        except ValueError:
            pass
    return EndIndex(Index(regex, plain()), None)


@lru_cache(maxsize=256)
def marks_cleanly(regex: str) -> bool:
    """Whether `regex` builds marked and, in its marked Index, may still end from every state a
    guide can reach: one whose every way to an end writes a NUL (the mark, never taken as text)
    would be a dead end. Checked on single bytes, which every token is a run of: the Index of
    `regex` marked over the 255 other bytes, walked forward from the start and back from where
    it may end. The walk holds the GIL, so it stops at MAX_WALK byte transitions and the regex
    stays plain (a pathological pattern's check must not stall the engine loop). True also
    proves the regex compiles: spec's check asks this first."""
    from outlines_core import Index
    try:
        index = Index(f"(?:{regex})\\x00", _marked_bytes())
    except ValueError:
        return False
    ahead = _walk(index)
    if ahead is None:
        return False
    behind: dict[int, set[int]] = {}
    for state, nexts in ahead.items():
        for nxt in nexts:
            behind.setdefault(nxt, set()).add(state)
    end = EndIndex(index, _BYTE_END)
    ends = [state for state in ahead if end.accepting(state)]
    return set(ahead) <= _reached(ends, behind)


def _walk(index: Index) -> dict[int, set[int]] | None:
    """The states reachable from the start without the mark, each with its next states; None
    past MAX_WALK transitions."""
    initial = index.get_initial_state()
    ahead: dict[int, set[int]] = {}
    todo, budget = [initial], MAX_WALK
    while todo:
        state = todo.pop()
        if state in ahead:
            continue
        tokens = [t for t in index.get_allowed_tokens(state) if t != _BYTE_END]
        budget -= len(tokens)
        if budget < 0:
            return None
        ahead[state] = {index.get_next_state(state, t) for t in tokens}
        todo.extend(nxt for nxt in ahead[state] if nxt not in ahead)
    return ahead


def _reached(start: list[int], edges: dict[int, set[int]]) -> set[int]:
    seen, todo = set(start), list(start)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@lru_cache(maxsize=1)
def _marked_bytes() -> Vocabulary:
    return marked_vocabulary({bytes([b]): [b] for b in range(256)}, _BYTE_END, 256)
