"""The constrained-decoding side of one engine: what the scheduler calls, and nothing else does.

    check(params)        at submission: the ConstraintSpec, or a ValueError naming the field
    start(spec)          a Future of the request's guide factory; already done when the Index (or
                         the llguidance tokenizer) is cached, else built on the worker thread
    mask(logits, ...)    before sampling: the constrained rows' bitmask, applied in place
    advance(req, token)  after sampling: the tokens to append (jump-forward may add some) and a
                         finish reason when the constraint is complete

The vocabulary, Indexes and the llguidance tokenizer are built lazily on one worker thread, so an
engine that never sees a constrained request never pays for them. (The worker exits when the
engine is collected.)

Logprobs of a constrained request are those of the masked distribution (what it sampled from).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from stemma.constrained import bitmask, jump_forward
from stemma.constrained.spec import ConstraintSpec, check
from stemma.constrained.vocab import TokenVocab, build_vocab
from stemma.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from outlines_core import Index
    from transformers import PreTrainedTokenizerBase

    from stemma.constrained.guide import Guide
    from stemma.engine.request import Request

GuideFactory = Callable[[], "Guide"]


@dataclass
class ConstraintStats:
    guided_tokens: int = 0      # tokens sampled under a mask
    forced_tokens: int = 0      # tokens appended by jump-forward (net of the sampled ones replaced)
    jumps: int = 0              # jump-forwards taken
    mask_time: float = 0.0      # seconds spent filling and applying masks


class Constrainer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 eos_token_ids: Sequence[int], enable_jump_forward: bool, index_cache_size: int):
        from stemma.constrained.index_cache import IndexCache
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.enable_jump_forward = enable_jump_forward
        self.indexes = IndexCache(index_cache_size)
        self.stats = ConstraintStats()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._vocab: TokenVocab | None = None
        self._end_tokens: bitmask.EndTokens | None = None
        self._lltokenizer: LLTokenizer | None = None

    # ---- submission ----
    def check(self, params: SamplingParams) -> ConstraintSpec | None:
        spec = check(params)
        if spec is not None and self.tokenizer is None:
            raise ValueError(f"{spec.field}: constrained decoding needs the model's tokenizer, "
                             "and this model has none")
        return spec

    def start(self, spec: ConstraintSpec) -> Future:
        """A Future of a function that makes the request's guide."""
        ready = self._ready_factory(spec)
        if ready is not None:
            done: Future = Future()
            done.set_result(ready)
            return done
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stemma-constrained")
        return self._executor.submit(self._build_factory, spec)

    def _ready_factory(self, spec: ConstraintSpec) -> GuideFactory | None:
        """The factory without building anything, when everything it needs is cached."""
        vocab = self._vocab
        if vocab is None:
            return None
        if spec.kind == "grammar":
            return self._grammar_factory(spec.source) if self._lltokenizer is not None else None
        index = self.indexes.lookup(spec.source, vocab.fingerprint)
        return None if index is None else self._regex_factory(index, vocab)

    def _build_factory(self, spec: ConstraintSpec) -> GuideFactory:  # on the worker thread
        vocab = self.vocab()
        if spec.kind == "grammar":
            if self._lltokenizer is None:
                from stemma.constrained.grammar import build_lltokenizer
                self._lltokenizer = build_lltokenizer(vocab, self.encode, self.tokenizer.bos_token_id)
            factory = self._grammar_factory(spec.source)
            factory()  # the grammar compiles against the real vocabulary here, not in the batch
            return factory
        return self._regex_factory(self.indexes.get(spec.source, vocab), vocab)

    def _regex_factory(self, index: Index, vocab: TokenVocab) -> GuideFactory:
        from stemma.constrained.guide import RegexGuide
        return lambda: RegexGuide(index, vocab)

    def _grammar_factory(self, grammar: str) -> GuideFactory:
        from stemma.constrained.grammar import GrammarGuide
        lltokenizer = self._lltokenizer
        return lambda: GrammarGuide(lltokenizer, grammar)

    def vocab(self) -> TokenVocab:
        with self._lock:
            if self._vocab is None:
                vocab = build_vocab(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._end_tokens = bitmask.EndTokens.of(vocab.end_ids)
                self._vocab = vocab
            return self._vocab

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- each step ----
    def mask(self, logits: torch.Tensor, guides: Sequence[Guide], rows: Sequence[int]) -> None:
        """Sets the logits that `guides` forbid (guide i for row rows[i]) to -inf, in place."""
        start = time.perf_counter()
        mask = bitmask.fill(guides, logits.shape[-1])
        self._end_tokens.set(mask, [g.is_final() for g in guides])
        bitmask.apply(logits, mask, rows)
        self.stats.guided_tokens += len(guides)
        self.stats.mask_time += time.perf_counter() - start

    def advance(self, req: Request, token: int) -> tuple[list[int], str | None]:
        """After `token` was sampled for `req`: (tokens to append, finish reason or None).

        Sets req.error when the guide refuses the token (finish reason "error"); the mask makes
        that a bug, but it ends one request, never the batch."""
        guide, vocab = req.constraint, self._vocab
        if token in vocab.end_ids:
            return [token], "stop"  # the mask allows an end token only where the guide is final
        if not guide.accept(token):
            req.error = f"the constraint refused token {token}: {guide.error}"
            return [], "error"
        if guide.is_terminated():
            return [token], "stop"
        if not self.enable_jump_forward or req.params.logprobs or req.params.top_logprobs:
            return [token], None  # logprob requests sample every token, so each has its logprob
        try:
            tokens = jump_forward.plan(guide, token, vocab, self.encode)
        except RuntimeError as exc:
            req.error = str(exc)
            return [token], "error"
        if tokens is None:
            return [token], None
        self.stats.jumps += 1
        self.stats.forced_tokens += len(tokens) - 1
        return tokens, "stop" if guide.is_terminated() else None
