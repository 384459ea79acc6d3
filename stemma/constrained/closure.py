"""Budget closure: a constrained output ends accepted within its token budget.

A request has `budget` tokens left (max_new_tokens, and the context, less what it has written).
Let d(s) be the length in tokens of the shortest completion from state s (0 where the constraint
is complete). Before each sample from state s with budget r, only the tokens t with
d(next(s, t)) <= r - 1 are kept (end tokens stay allowed where s is final). Far from the end this
forbids nothing; where r reaches d(s) it keeps exactly the tokens on a shortest path (d drops by
one, or the token completes the constraint). So an output that could still be completed when the
budget got that short ends accepted, and one whose budget was too small from the start is left
alone (it ends "length", and the constrainer says so in the request's meta["error"]).

Regexes and JSON schemas (outlines-core): d is exact. `RegexClosure.build` walks the Index's
states and token transitions once (breadth first from the initial state, then backwards from the
states where the regex may end) on the constrainer's worker thread, right after the Index is
built, and is cached with it. Per state it keeps only what a restriction needs: the tokens that
make progress (d drops by one), and the few that move further from the end (d grows), sorted by
how far. A step whose budget is at least the largest d(next) of its state, the usual case, costs
a dictionary lookup.

Grammars (llguidance): llguidance has no shortest-path facility, and its matcher states can be
neither enumerated nor compared. `GrammarSearch` finds a short completion by a bounded breadth-
first search over bytes on a twin matcher of the same grammar over a 257-token byte vocabulary
(a node costs a few microseconds), keeping at each depth a few of the states that allow the same
next bytes (see shortest_bytes); the bytes found are then split into the fewest vocabulary
tokens. The result is a completion, short but not always the shortest: GrammarGuide follows it
once the budget reaches its length, replaces a sampled token after which no completion is found
within the budget by the plan's next token, and reports in meta["error"] where it found none.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from stemma.constrained.end_mark import EndIndex
    from stemma.constrained.vocab import TokenVocab

UNREACHABLE = 1 << 30        # d of a state from which no final state can be reached
MAX_EDGES = 50_000_000       # an Index with more token transitions gets no closure table (the
                             # walk keeps them all for a moment: 12 bytes each)
SEARCH_NODES = 8192          # most byte states one grammar search tries
SEARCH_BYTES = 256           # longest byte completion a grammar search looks for


def budget_error(shortest: int | None, budget: int, kind: str) -> str:
    """The meta["error"] of a request whose budget cannot hold a complete output."""
    if shortest is None:
        return (f"constraint budget: no completion of the {kind} was found within the "
                f"{budget} tokens left; the output may be incomplete")
    if shortest >= UNREACHABLE:
        return "constraint budget: no complete output can be written in this vocabulary"
    return (f"constraint budget: the shortest complete output ({shortest} tokens) is longer than "
            f"the {budget} tokens left; the output is incomplete")


# ------------------------------------------------------------------ regexes (outlines-core)


@dataclass(frozen=True)
class _State:
    distance: int          # d(s)
    widest: int            # the largest d(next) over the state's tokens: no restriction while
                           # the budget is above it
    progress: tuple        # (words, bits): the tokens with d(next) == d(s) - 1, by bitmask word
    away: np.ndarray       # the tokens with d(next) > d(s), farthest first
    away_d: np.ndarray     # their d(next), non-increasing


class RegexClosure:
    """Shortest-completion lengths of one outlines-core Index, and the budget restriction."""

    def __init__(self, states: dict[int, _State], initial: int, edges: int, seconds: float):
        self._states = states
        self.initial = initial
        self.edges = edges          # token transitions walked
        self.seconds = seconds      # build time
        self.kept = sum(len(s.away) + int(s.progress[0].size) for s in states.values())

    @classmethod
    def build(cls, end_index: EndIndex, eos_token_id: int) -> "RegexClosure":
        start = time.perf_counter()
        index = end_index.index
        initial = index.get_initial_state()
        walked: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # state -> (tokens, next states)
        preds: dict[int, list[int]] = {}
        seen, queue, edges = {initial}, deque([initial]), 0
        step = index.get_next_state
        while queue:
            state = queue.popleft()
            allowed = [t for t in index.get_allowed_tokens(state) if t != eos_token_id]
            nxt = np.fromiter((step(state, t) for t in allowed), dtype=np.int64, count=len(allowed))
            walked[state] = (np.asarray(allowed, dtype=np.int32), nxt)
            edges += len(allowed)
            if edges > MAX_EDGES:
                raise ValueError(f"the Index has over {MAX_EDGES} token transitions")
            for succ in np.unique(nxt).tolist():
                preds.setdefault(succ, []).append(state)
                if succ not in seen:
                    seen.add(succ)
                    queue.append(succ)
        distance = {s: 0 for s in walked if end_index.accepting(s)}
        queue = deque(distance)
        while queue:
            state = queue.popleft()
            for pred in preds.get(state, ()):
                if pred not in distance:
                    distance[pred] = distance[state] + 1
                    queue.append(pred)
        ids = np.array(sorted(walked), dtype=np.int64)   # every state, sorted: d by position
        by_id = np.array([distance.get(s, UNREACHABLE) for s in ids.tolist()], dtype=np.int64)
        states = {}
        for state, (toks, nxt) in walked.items():
            ds = distance.get(state, UNREACHABLE)
            dn = by_id[np.searchsorted(ids, nxt)]
            away = dn > ds
            order = np.argsort(-dn[away], kind="stable")
            states[state] = _State(distance=ds, widest=int(dn.max()) if len(dn) else -1,
                                   progress=_by_word(toks[dn == ds - 1]),
                                   away=toks[away][order], away_d=dn[away][order])
            walked[state] = None  # type: ignore[assignment]  # frees the transitions as it goes
        return cls(states, initial, edges, time.perf_counter() - start)

    def distance(self, state: int) -> int:
        found = self._states.get(state)
        return UNREACHABLE if found is None else found.distance

    def restrict(self, row: np.ndarray, state: int, budget: int) -> bool:
        """Narrows the filled uint32 bitmask `row` of `state` to the tokens that can still complete
        within `budget` tokens, this one included; False when nothing had to change (or nothing
        can help: the budget is already too small)."""
        s = self._states.get(state)
        if s is None or s.distance > budget or s.widest < budget:
            return False
        if s.distance == budget:  # on a shortest path only
            words, bits = s.progress
            row[:] = 0
            row[words] = bits
            return True
        cut = int(np.searchsorted(-s.away_d, -budget, side="right"))  # d(next) >= budget
        if cut:
            _clear(row, s.away[:cut])
        return bool(cut)


def _by_word(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct bitmask words, the OR of their tokens' bits) of a set of token ids."""
    tokens = np.sort(tokens)
    words = tokens >> 5
    bits = (np.uint32(1) << (tokens & 31).astype(np.uint32)).astype(np.uint32)
    if not len(tokens):
        return words, bits
    unique, first = np.unique(words, return_index=True)
    return unique, np.bitwise_or.reduceat(bits, first)


def _clear(row: np.ndarray, tokens: np.ndarray) -> None:
    words, bits = _by_word(tokens)
    row[words] &= ~bits


# ------------------------------------------------------------------ grammars (llguidance)


class _ByteTokenizer:
    """256 byte tokens and an EOS (256), for llguidance.TokenizerWrapper."""
    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@lru_cache(maxsize=1)
def byte_lltokenizer() -> LLTokenizer:
    from llguidance import LLTokenizer, TokenizerWrapper
    return LLTokenizer(TokenizerWrapper(_ByteTokenizer()), n_vocab=257, eos_token=[256])


def _byte_classes() -> tuple[np.ndarray, np.ndarray]:
    """Each byte's search class, and its tier. Printable ASCII punctuation bytes are classes of
    their own; digits, lowercase and uppercase letters are one class each (tier 0); whitespace
    bytes are their own classes (tier 1); the other control bytes and the non-ASCII bytes are one
    class each (tier 2)."""
    classes = np.arange(256)
    classes[ord("0"):ord("9") + 1] = 256
    classes[ord("a"):ord("z") + 1] = 257
    classes[ord("A"):ord("Z") + 1] = 258
    tier = np.full(256, 2)
    tier[0x21:0x7F] = 0
    tier[list(b" \t\n\r")] = 1
    classes[(tier == 2) & (np.arange(256) < 0x80)] = 259
    classes[0x80:] = 260
    return classes, tier


_CLASSES, _TIER = _byte_classes()
_ORDER = np.argsort(_TIER, kind="stable")  # tier 0 bytes first, in byte order


def _candidates(mask: bytes) -> list[int]:
    """The bytes a search tries after a state: the first allowed byte of each class, by tier."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8)[:32], bitorder="little")
    allowed = _ORDER[bits[_ORDER] != 0]
    _, first = np.unique(_CLASSES[allowed], return_index=True)
    return allowed[np.sort(first)].tolist()


_OPENS = np.zeros(256, dtype=np.int64)
_OPENS[list(b"([{<")] = 1
_OPENS[list(b")]}>")] = -1


def shortest_bytes(matcher: LLMatcher, max_nodes: int = SEARCH_NODES,
                   max_bytes: int = SEARCH_BYTES) -> bytes | None:
    """A short byte string that completes `matcher`'s grammar (b"" where it is accepting), or None
    when none was found within `max_nodes` states tried.

    Breadth first over bytes, so what it finds is the shortest but for two shortcuts. At each
    node only the first allowed byte of each class is tried (one digit, one lowercase letter, ...;
    every punctuation and whitespace byte), printable ones first. And at each depth, of the
    states that allow the same next bytes, three are kept: the first found, the one whose path
    opened the fewest brackets (`([{<` less `)]}>`; then the fewest stalls), and the one whose
    path stalled least (then opened the fewest; a stall is a byte after which the same bytes are
    allowed as before it, as inside a string). States that look alike can differ in what they
    still need (how many brackets are open, say), which no local test tells apart: the two
    counts are guesses at it."""
    if matcher.is_accepting():
        return b""
    frontier = [(matcher, b"", matcher.compute_bitmask(), 0, 0)]
    tried = 0
    for _ in range(max_bytes):
        groups: dict[bytes, list] = {}
        for node, path, mask, opened, stalled in frontier:
            for byte in _candidates(mask):
                child = node.deep_copy()
                if not child.consume_token(byte):
                    continue
                if child.is_accepting():
                    return path + bytes([byte])
                tried += 1
                if tried > max_nodes:
                    return None
                signature = child.compute_bitmask()
                entry = (child, path + bytes([byte]), signature, opened + int(_OPENS[byte]),
                         stalled + (signature == mask))
                group = groups.get(signature)
                if group is None:
                    groups[signature] = [entry, entry, entry]
                    continue
                if (entry[3], entry[4]) < (group[1][3], group[1][4]):
                    group[1] = entry
                if (entry[4], entry[3]) < (group[2][4], group[2][3]):
                    group[2] = entry
        if not groups:
            return None
        frontier = []
        for group in groups.values():
            frontier += {id(e): e for e in group}.values()
    return None


class TokenSplitter:
    """Bytes -> the fewest vocabulary tokens that spell them (dynamic programming)."""

    def __init__(self, vocab: TokenVocab):
        self._ids: dict[bytes, int] = {}
        for token_id, piece in enumerate(vocab.token_bytes):
            if piece:
                self._ids.setdefault(piece, token_id)
        self._longest = max((len(p) for p in self._ids), default=1)

    def split(self, data: bytes) -> list[int] | None:
        n = len(data)
        best: list[tuple[int, int, int] | None] = [None] * (n + 1)  # (count, start, token)
        best[0] = (0, 0, -1)
        for i in range(n):
            if best[i] is None:
                continue
            count = best[i][0] + 1
            for j in range(i + 1, min(n, i + self._longest) + 1):
                token = self._ids.get(data[i:j])
                if token is not None and (best[j] is None or best[j][0] > count):
                    best[j] = (count, i, token)
        if best[n] is None:
            return None
        out, j = [], n
        while j:
            _, i, token = best[j]
            out.append(token)
            j = i
        return out[::-1]


class GrammarClosure:
    """What every grammar guide of one vocabulary shares: the token splitter (built once, on the
    constrainer's worker: about 0.2 s for 262k tokens) and the EOS a stop is forced with."""

    def __init__(self, vocab: TokenVocab):
        self.vocab = vocab
        self.splitter = TokenSplitter(vocab)
        self.eos_token_id = vocab.eos_token_id

    def search(self, grammar: str) -> "GrammarSearch":
        return GrammarSearch(grammar, self.vocab, self.splitter)


class GrammarSearch:
    """A grammar's twin on the byte vocabulary, kept in step with a guide's tokens, and the
    search for a completion in vocabulary tokens."""

    def __init__(self, grammar: str, vocab: TokenVocab, splitter: TokenSplitter):
        from llguidance import LLMatcher
        self._matcher = LLMatcher(byte_lltokenizer(), LLMatcher.grammar_from_lark(grammar), log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"grammar is invalid: {self._matcher.get_error()}")
        self._vocab = vocab
        self._splitter = splitter
        self.searches = 0
        self.seconds = 0.0
        self._tokens: list[int] = []     # the guide tokens the twin has consumed
        self._lengths: list[int] = []    # bytes of each

    def sync(self, tokens: list[int]) -> bool:
        """Brings the twin to the state after `tokens`; False when it refuses them."""
        keep = 0
        for a, b in zip(self._tokens, tokens):
            if a != b:
                break
            keep += 1
        if keep < len(self._tokens):
            self._matcher.rollback(sum(self._lengths[keep:]))
            del self._tokens[keep:], self._lengths[keep:]
        for token in tokens[keep:]:
            piece = self._vocab.token_bytes[token] or b""
            if not self._matcher.consume_tokens(list(piece)):
                self._matcher.reset()
                self._tokens, self._lengths = [], []
                return False
            self._tokens.append(token)
            self._lengths.append(len(piece))
        return True

    def plan(self, tokens: list[int]) -> list[int] | None:
        """Vocabulary tokens that complete the grammar after `tokens`, or None (none found)."""
        if not self.sync(tokens):
            return None
        start = time.perf_counter()
        found = shortest_bytes(self._matcher)
        self.searches += 1
        self.seconds += time.perf_counter() - start
        if found is None:
            return None
        return self._splitter.split(found) if found else []
