"""The end-marked outlines-core Index against Python's `re`, on random small regexes: the texts it
lets a guide end on are exactly the regex's matches, and a token is allowed exactly where the
text stays the start of a match (outlines-core's own Index drops the ways on from a state where
the regex may end)."""
from __future__ import annotations

import itertools
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from stemma.constrained.index_cache import IndexCache
from stemma.constrained.vocab import TokenVocab

ALPHABET = "abc"
PIECES = ("a", "b", "c", "ab", "bc", "ca", "abc", "\x00", "a\x00")  # with NUL: never allowed
VOCAB = TokenVocab(token_bytes=(None, *(p.encode() for p in PIECES)), eos_token_id=0, end_ids=(0,),
                   special={0: "</s>"})
LONGEST = 4   # texts compared up to this length
LEAVES = 5    # one character each: a start of a match completes within LEAVES more


def regexes():
    leaf = st.sampled_from([*ALPHABET, "[ab]", "[^a\\x00]"])
    return st.recursive(leaf, lambda inner: st.one_of(
        st.tuples(inner, inner).map(lambda t: f"{t[0]}{t[1]}"),
        st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
        inner.map(lambda r: f"(?:{r})?"),
        inner.map(lambda r: f"(?:{r})*"),
    ), max_leaves=LEAVES)


def language(regex: str, longest: int) -> set[str]:
    return {"".join(t) for n in range(longest + 1) for t in itertools.product(ALPHABET, repeat=n)
            if re.fullmatch(regex, "".join(t))}


@settings(max_examples=100, deadline=None)
@given(regexes())
def test_the_marked_index_allows_exactly_the_starts_of_matches(regex):
    ends = IndexCache(1).get(regex, VOCAB)
    assert ends.end == VOCAB.eos_token_id  # marked
    index, matches = ends.index, language(regex, LONGEST + LEAVES)
    starts = {m[:i] for m in matches for i in range(len(m) + 1)}
    reached, frontier = {"": index.get_initial_state()}, [""]
    while frontier:
        text = frontier.pop()
        state = reached[text]
        assert ends.accepting(state) == (text in matches), (regex, text)
        allowed = set(index.get_allowed_tokens(state)) - {VOCAB.eos_token_id}
        for token_id, piece in enumerate(PIECES, start=1):
            longer = text + piece
            if len(longer) > LONGEST:
                continue
            assert (token_id in allowed) == (longer in starts), (regex, text, piece)
            if token_id in allowed and len(piece) == 1 and longer not in reached:
                reached[longer] = index.get_next_state(state, token_id)
                frontier.append(longer)
    assert {t for t in reached if t in matches} == {m for m in matches if len(m) <= LONGEST}
