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

The cost: a constrained output never writes a NUL. A regex whose every match holds a NUL, or one
that cannot be built so (`a$`), gets the plain Index, cut short as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from outlines_core import Index, Vocabulary

MARK = b"\x00"


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
    """The EndIndex of `regex`: marked (`marked` from marked_vocabulary with `eos`) where it
    builds, else plain (`plain()` gives the Vocabulary of the text tokens under `eos`)."""
    from outlines_core import Index
    if _matches_without_mark(regex):
        try:
            return EndIndex(Index(f"(?:{regex})\\x00", marked), eos)
        except ValueError:
            pass
    return EndIndex(Index(regex, plain()), None)


@lru_cache(maxsize=256)
def _matches_without_mark(regex: str) -> bool:
    """Whether `regex` matches some text without a NUL: its Index over the other 255 bytes builds
    (outlines-core's build fails where no final state can be reached)."""
    from outlines_core import Index
    try:
        Index(regex, _bytes_but_mark())
    except ValueError:
        return False
    return True


@lru_cache(maxsize=1)
def _bytes_but_mark() -> Vocabulary:
    from outlines_core import Vocabulary
    return Vocabulary(256, {bytes([b]): [b] for b in range(256) if bytes([b]) != MARK})
