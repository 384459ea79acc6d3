"""The end-marked outlines-core Index against Python's `re`, on random small regexes: the texts it
lets a guide end on are exactly the regex's matches without a NUL (the mark), a token is allowed
exactly where the text stays the start of one, and no state it reaches is a dead end
(outlines-core's own Index drops the ways on from a state where the regex may end). A regex that
would leave a dead end gets the plain Index, which must still be sound and leave none."""
from __future__ import annotations

import itertools
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from stemma.constrained.index_cache import IndexCache
from stemma.constrained.vocab import TokenVocab

ALPHABET = "ab\x00"
PIECES = ("a", "b", "\x00", "ab", "ba", "aba", "a\x00")
VOCAB = TokenVocab(token_bytes=(None, *(p.encode() for p in PIECES)), eos_token_id=0, end_ids=(0,),
                   special={0: "</s>"})
LONGEST = 4   # texts compared up to this length
LEAVES = 5    # one character each: a start of a match completes within LEAVES more


def regexes():
    leaf = st.sampled_from(["a", "b", "[ab]", "[^a]", "\\x00"])
    return st.recursive(leaf, lambda inner: st.one_of(
        st.tuples(inner, inner).map(lambda t: f"{t[0]}{t[1]}"),
        st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
        inner.map(lambda r: f"(?:{r})?"),
        inner.map(lambda r: f"(?:{r})*"),
    ), max_leaves=LEAVES)


def language(regex: str, longest: int) -> set[str]:
    return {"".join(t) for n in range(longest + 1) for t in itertools.product(ALPHABET, repeat=n)
            if re.fullmatch(regex, "".join(t))}


@settings(max_examples=120, deadline=None)
@given(regexes())
def test_the_marked_index_allows_exactly_the_starts_of_matches(regex):
    ends = IndexCache(1).get(regex, VOCAB)
    marked = ends.end is not None
    assert marked or "\\x00" in regex  # only a NUL can keep a regex plain here
    index, matches = ends.index, language(regex, LONGEST + LEAVES)
    usable = {m for m in matches if "\x00" not in m} if marked else matches
    starts = {m[:i] for m in usable for i in range(len(m) + 1)}
    reached, frontier = {"": index.get_initial_state()}, [""]
    while frontier:
        text = frontier.pop()
        state = reached[text]
        assert text in starts, (regex, text)  # never a dead end
        assert ends.accepting(state) == (text in matches), (regex, text)
        allowed = set(index.get_allowed_tokens(state)) - {VOCAB.eos_token_id}
        for token_id, piece in enumerate(PIECES, start=1):
            longer = text + piece
            if len(longer) > LONGEST or token_id not in allowed and not marked:
                continue  # the plain Index drops some ways on: only what it allows is checked
            assert (token_id in allowed) == (longer in starts), (regex, text, piece)
            if token_id in allowed and len(piece) == 1 and longer not in reached:
                reached[longer] = index.get_next_state(state, token_id)
                frontier.append(longer)
    if marked:
        assert {t for t in reached if t in matches} == {m for m in usable if len(m) <= LONGEST}


def test_a_regex_too_large_to_walk_stays_plain():
    """The dead-end walk holds the GIL, so it stops at MAX_WALK byte transitions: a pathological
    pattern's check (2**15 states, two ways on each) took 0.7 s of the engine loop's GIL, and a
    simple request behind three of them waited 3.9 s in a full suite."""
    from stemma.constrained import end_mark
    assert not end_mark.marks_cleanly("(a|b)*a(a|b){15}")
    assert end_mark.marks_cleanly("(a|b)*a(a|b){3}")
