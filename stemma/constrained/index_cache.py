"""outlines-core Indexes, cached by (regex, vocabulary fingerprint), least recently used first out.

An Index over a 262k-token vocabulary takes about a second per regex to build (a JSON schema's
two), so it is built once per (pattern, tokenizer) and shared by every request that asks for it.
Builds run on the constrainer's worker thread (outlines-core releases the GIL while building);
lookups come from the scheduler thread, hence the lock.

Each Index is an end_mark.EndIndex: built for the regex with an end mark, so that no way on from
a state where the regex may end is lost (outlines-core drops them), or plainly where that fails.
With an Index the cache keeps its budget-closure table (closure.RegexClosure: every state's
shortest-completion length), built on the same worker right after the Index and evicted with it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from stemma.constrained import end_mark

if TYPE_CHECKING:
    from outlines_core import Vocabulary

    from stemma.constrained.closure import RegexClosure
    from stemma.constrained.end_mark import EndIndex
    from stemma.constrained.vocab import TokenVocab


logger = logging.getLogger(__name__)


class IndexCache:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], EndIndex] = OrderedDict()
        self._vocabularies: dict[tuple[str, bool], Vocabulary] = {}  # by (fingerprint, marked)
        self._closures: dict[tuple[str, str], RegexClosure] = {}  # of the cached Indexes only
        self._lock = threading.Lock()
        self.builds = 0

    def lookup(self, regex: str, fingerprint: str) -> EndIndex | None:
        """The cached Index, or None."""
        with self._lock:
            index = self._entries.get((regex, fingerprint))
            if index is not None:
                self._entries.move_to_end((regex, fingerprint))
            return index

    def get(self, regex: str, vocab: TokenVocab) -> EndIndex:
        """The Index of `regex` over `vocab`, built here when not cached."""
        index = self.lookup(regex, vocab.fingerprint)
        if index is not None:
            return index
        started = time.perf_counter()
        logger.info("building the constraint index of a new pattern (%d-char regex) over %d tokens; "
                    "requests with it wait until it is built (about 1-2 s on a large vocabulary, "
                    "then cached)", len(regex), vocab.size)
        index = end_mark.build(regex, self._vocabulary(vocab, marked=True),
                               lambda: self._vocabulary(vocab, marked=False), vocab.eos_token_id)
        logger.info("built the constraint index in %.1f s", time.perf_counter() - started)
        with self._lock:
            self.builds += 1
            self._entries[(regex, vocab.fingerprint)] = index
            while len(self._entries) > self.capacity:
                key, _ = self._entries.popitem(last=False)
                self._closures.pop(key, None)
        return index

    def lookup_closure(self, regex: str, fingerprint: str, missing: object = None) -> RegexClosure | None:
        """The cached closure table of a cached Index; None where it could not be built;
        `missing` where it was not."""
        with self._lock:
            return self._closures.get((regex, fingerprint), missing)

    def add_closure(self, regex: str, vocab: TokenVocab, index: EndIndex) -> RegexClosure | None:
        """Builds the closure table of `index` (the Index of `regex` over `vocab`) and keeps it
        while the Index is cached; None (kept too, so it is not tried again) when it cannot be
        built (an Index with too many transitions)."""
        from stemma.constrained.closure import RegexClosure
        try:
            closure = RegexClosure.build(index, vocab.eos_token_id)
        except (ValueError, MemoryError) as exc:
            logger.warning("no budget closure for regex of %d chars: %s", len(regex), exc)
            closure = None
        with self._lock:
            if (regex, vocab.fingerprint) in self._entries:
                self._closures[(regex, vocab.fingerprint)] = closure
        return closure

    def __len__(self) -> int:
        return len(self._entries)

    def _vocabulary(self, vocab: TokenVocab, marked: bool) -> Vocabulary:
        """outlines-core's Vocabulary of a TokenVocab, made once: marked (end_mark.marked_vocabulary,
        its stand-in EOS the id past the vocabulary), or plain (the text tokens and the EOS)."""
        from outlines_core import Vocabulary
        made = self._vocabularies.get((vocab.fingerprint, marked))
        if made is None:
            text = vocab.text_map()
            made = (end_mark.marked_vocabulary(text, vocab.eos_token_id, vocab.size) if marked
                    else Vocabulary(vocab.eos_token_id, text))
            self._vocabularies[(vocab.fingerprint, marked)] = made
        return made
