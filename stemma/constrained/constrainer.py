"""The constrained-decoding side of one engine: what the scheduler calls, and nothing else does.

    check(params)        at submission: the ConstraintSpec, or a ValueError naming the field; a
                         Future of either when compiling outlasts CHECK_WINDOW_S (it goes on in
                         the background, and the batch never waits for it)
    start(spec)          a Future of the request's guide factory; already done when the Index (or
                         the llguidance tokenizer) is cached, else built on the worker thread
    abandon()            after a build timed out: later checks and builds run on fresh threads
                         (see stemma.constrained.worker: a compile cannot be interrupted)
    attach(req, ...)     when it is built: the request's guide, with its token budget
    mask(logits, ...)    before sampling: the constrained rows' bitmask, applied in place
    advance(req, token)  after sampling: the tokens to append (jump-forward may add some) and a
                         finish reason when the constraint is complete

Budget closure (`budget_closure`, on unless EngineConfig.constraint_budget_closure is False; see
stemma.constrained.closure): each guide knows how many tokens its request may still append
(max_new_tokens and the context, less its output), the mask keeps only tokens after which the
constraint can still be completed within that budget, and a jump-forward whose forced tokens
would leave no completion within it is not taken. A request whose budget cannot hold any complete
output runs unrestricted and ends "length" with meta["error"] saying so.

The vocabulary, Indexes and the llguidance tokenizer are built lazily on one worker thread, so an
engine that never sees a constrained request never pays for them; submission checks run on
another, so that a long build never delays them. (Idle workers exit; see constrained.worker.)

Logprobs of a constrained request are those of the masked distribution (what it sampled from).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from stemma.constrained import bitmask, jump_forward
from stemma.constrained.closure import budget_error
from stemma.constrained.spec import CONSTRAINT_FIELDS, ConstraintSpec, check
from stemma.constrained.worker import Worker
from stemma.constrained.vocab import TokenVocab, build_vocab
from stemma.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from transformers import PreTrainedTokenizerBase

    from stemma.constrained.closure import GrammarClosure, RegexClosure
    from stemma.constrained.end_mark import EndIndex
    from stemma.constrained.guide import Guide
    from stemma.engine.request import Request

_MISSING = object()  # IndexCache.lookup_closure: no table built yet

GuideFactory = Callable[[], "Guide"]
LOGPROB_MARGIN = 2     # a grammar request asking for logprobs follows its completion this early
CLOSURE_LOG = 4096     # closure_starts kept
CHECK_WINDOW_S = 0.25  # a constraint that compiles within this is refused at submission if bad


@dataclass
class ConstraintStats:
    guided_tokens: int = 0      # tokens sampled under a mask
    forced_tokens: int = 0      # tokens appended by jump-forward (net of the sampled ones replaced)
    jumps: int = 0              # jump-forwards taken
    mask_time: float = 0.0      # seconds spent filling and applying masks (closure included)
    closure_time: float = 0.0   # seconds of it spent on budget closure (masks, searches)
    closed_rows: int = 0        # mask rows the budget closure narrowed
    closed_requests: int = 0    # requests whose output the budget closure changed
    refused_jumps: int = 0      # jump-forwards not taken: they would overrun the budget
    replaced_tokens: int = 0    # sampled grammar tokens replaced by the completion's next one
    closure_builds: int = 0     # shortest-completion tables built (one per regex Index)
    closure_build_time: float = 0.0  # their seconds, on the worker thread


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
        self._builds = Worker("stemma-constrained")
        self._checks = Worker("stemma-constraint-check")
        self._lock = threading.Lock()
        self._vocab: TokenVocab | None = None
        self._end_tokens: bitmask.EndTokens | None = None
        self._lltokenizer: LLTokenizer | None = None
        self._grammar_closure: GrammarClosure | None = None
        self.budget_closure = True  # the scheduler sets it from EngineConfig
        # rid -> output length where budget closure first changed the request (the latest 4096)
        self.closure_starts: OrderedDict[str, int] = OrderedDict()

    # ---- submission ----
    def check(self, params: SamplingParams) -> ConstraintSpec | Future:
        """The constraint of a constrained request, compiled once to prove it sound (a ValueError
        naming the field when it is not), or a Future of that when compiling takes longer than
        CHECK_WINDOW_S: a pathological pattern compiles on the check thread, outside the batch,
        and fails its request only (the scheduler's build timeout bounds it)."""
        if self.tokenizer is None:
            field = next(f for f in CONSTRAINT_FIELDS if getattr(params, f) is not None)
            raise ValueError(f"{field}: constrained decoding needs the model's tokenizer, "
                             "and this model has none")
        future = self._checks.submit(check, params)
        try:
            return future.result(CHECK_WINDOW_S)
        except TimeoutError:
            return future

    def start(self, spec: ConstraintSpec | Future) -> Future:
        """A Future of a function that makes the request's guide (`spec`: what `check` gave)."""
        if isinstance(spec, Future):
            return _then(spec, self.start)
        ready = self._ready_factory(spec)
        if ready is not None:
            done: Future = Future()
            done.set_result(ready)
            return done
        return self._builds.submit(self._build_factory, spec)

    def abandon(self) -> None:
        """A build or check outlived its timeout: leave it to its thread; the queued ones (and
        all later ones) run on fresh threads, so the stuck one blocks nothing."""
        self._checks.abandon()
        self._builds.abandon()

    @property
    def abandoned_builds(self) -> int:
        return self._checks.abandoned + self._builds.abandoned

    def _ready_factory(self, spec: ConstraintSpec) -> GuideFactory | None:
        """The factory without building anything, when everything it needs is cached."""
        vocab = self._vocab
        if vocab is None:
            return None
        if spec.kind == "grammar":
            if self._lltokenizer is None or (self.budget_closure and self._grammar_closure is None):
                return None
            return self._grammar_factory(spec.source)
        index = self.indexes.lookup(spec.source, vocab.fingerprint)
        if index is None:
            return None
        closure = None
        if self.budget_closure:
            closure = self.indexes.lookup_closure(spec.source, vocab.fingerprint, missing=_MISSING)
            if closure is _MISSING:
                return None
        return self._regex_factory(index, vocab, closure)

    def _build_factory(self, spec: ConstraintSpec) -> GuideFactory:  # on the worker thread
        vocab = self.vocab()
        if spec.kind == "grammar":
            if self._lltokenizer is None:
                from stemma.constrained.grammar import build_lltokenizer
                self._lltokenizer = build_lltokenizer(vocab, self.encode, self.tokenizer.bos_token_id)
            if self.budget_closure and self._grammar_closure is None:
                from stemma.constrained.closure import GrammarClosure
                self._grammar_closure = GrammarClosure(vocab)
            factory = self._grammar_factory(spec.source)
            factory()  # the grammar compiles against the real vocabulary here, not in the batch
            return factory
        index = self.indexes.get(spec.source, vocab)
        closure = None
        if self.budget_closure:
            closure = self.indexes.lookup_closure(spec.source, vocab.fingerprint, missing=_MISSING)
            if closure is _MISSING:  # built here, beside the Index; None: it cannot be
                start = time.perf_counter()
                closure = self.indexes.add_closure(spec.source, vocab, index)
                self.stats.closure_builds += 1
                self.stats.closure_build_time += time.perf_counter() - start
        return self._regex_factory(index, vocab, closure)

    def _regex_factory(self, index: EndIndex, vocab: TokenVocab,
                       closure: RegexClosure | None) -> GuideFactory:
        from stemma.constrained.guide import RegexGuide
        return lambda: RegexGuide(index, vocab, closure)

    def _grammar_factory(self, grammar: str) -> GuideFactory:
        from stemma.constrained.grammar import GrammarGuide
        lltokenizer = self._lltokenizer
        closure = self._grammar_closure if self.budget_closure else None
        return lambda: GrammarGuide(lltokenizer, grammar, closure)

    def attach(self, req: Request, factory: GuideFactory, max_context: int) -> Guide:
        """The guide of `req` (made by the factory `start` gave), with its token budget when
        budget closure is on. A budget too small for any complete output is not enforced: the
        request runs as it would without closure and says so in req.error (meta["error"])."""
        guide = factory()
        if not self.budget_closure:
            return guide
        budget = min(req.remaining_new_tokens, max_context - len(req.tokens))
        guide.budget = budget
        if req.params.logprobs or req.params.top_logprobs:
            guide.margin = LOGPROB_MARGIN  # their sampled tokens are never replaced
        shortest = guide.shortest() if guide.exact_closure else None
        if shortest is not None and shortest > budget:
            guide.budget = None
            req.error = budget_error(shortest, budget, "constraint")
        return guide

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
    def mask(self, logits: torch.Tensor, guides: Sequence[Guide], rows: Sequence[int],
             hold: Sequence[bool] = ()) -> None:
        """Sets the logits that `guides` forbid (guide i for row rows[i]) to -inf, in place. An
        end token is allowed where the guide is complete, except where `hold[i]` (the request
        wants more: it ignores EOS, or has fewer than min_new_tokens) and the guide allows more
        than an end there."""
        start = time.perf_counter()
        mask = bitmask.fill(guides, logits.shape[-1])
        if self.budget_closure:
            self._close(mask, guides)
        final = [g.is_final() for g in guides]
        if any(hold):
            self._end_tokens.set(mask, [False] * len(guides))
            more = mask.ne(0).any(dim=1).tolist()
            final = [f and not (h and m) for f, h, m in zip(final, [*hold, *[False] * len(guides)], more)]
        self._end_tokens.set(mask, final)
        bitmask.apply(logits, mask, rows)
        self.stats.guided_tokens += len(guides)
        self.stats.mask_time += time.perf_counter() - start

    def allowed_drafts(self, req: Request, drafts: list[int]) -> int:
        """How many of `drafts` (tokens after req's last one) its guide accepts in a row; an end
        token ends the drafts (a stop is never drafted). The guide is left as it was."""
        guide, ends = req.constraint, self._vocab.end_ids  # built: req has a guide
        n = next((j for j, t in enumerate(drafts) if t in ends), len(drafts))
        if not n:
            return 0
        saved = _trial_state(guide)
        taken = guide.accept_many(drafts[:n])
        if taken:
            guide.rollback(taken)
        _restore(guide, saved)
        return taken

    def forced_drafts(self, req: Request, k: int) -> list[int]:
        """Up to k tokens spelling the bytes req's guide forces from here (the text jump-forward
        would append), as free drafts: verification keeps them where the model's tokenization
        agrees, with their logprobs. Only where jump-forward does not run (a request asking for
        logprobs, or jump-forward off): elsewhere it has appended that text already. Empty when
        nothing is forced."""
        if self.enable_jump_forward and not (req.params.logprobs or req.params.top_logprobs):
            return []
        data = jump_forward.whole_utf8(req.constraint.forced_bytes(jump_forward.FORCED_BYTES_LIMIT))
        if not data:
            return []
        tokens = self.encode(data.decode("utf-8"))[:k]
        return tokens[:self.allowed_drafts(req, tokens)]

    def mask_path(self, logits: torch.Tensor, guide: Guide, drafts: list[int], rows: Sequence[int],
                  hold: Sequence[bool] = ()) -> None:
        """Masks rows[j] as `guide` stands after drafts[:j], each with the budget left there, for
        the len(drafts) + 1 rows that verify them (allowed_drafts cut them, so every draft is
        accepted); `hold[j]` as mask's for rows[j]. The guide is left as it was."""
        budget = guide.budget if self.budget_closure else None
        taken, saved = 0, None
        try:
            for j, row in enumerate(rows):
                if budget is not None:
                    guide.budget = budget - j
                self.mask(logits, [guide], [row], hold[j:j + 1])
                if j == 0:  # row 0 is the request's real state: what its mask caches is kept
                    saved = _trial_state(guide)
                if j < len(drafts):
                    if guide.accept_many([drafts[j]]) != 1:
                        raise RuntimeError(f"the constraint refused draft token {drafts[j]} it had allowed")
                    taken += 1
        finally:
            if taken:
                guide.rollback(taken)
            if saved is not None:
                _restore(guide, saved)
            if budget is not None:
                guide.budget = budget

    def _close(self, mask: torch.Tensor, guides: Sequence[Guide]) -> None:
        """Budget closure: narrows each budgeted guide's row to what still completes in time."""
        start = time.perf_counter()
        words = None
        for i, guide in enumerate(guides):
            if getattr(guide, "budget", None) is None:
                continue
            if words is None:
                words = mask.numpy().view(np.uint32)
            if guide.restrict(words[i]):
                self.stats.closed_rows += 1
                guide.closure_acted = True
        self.stats.closure_time += time.perf_counter() - start

    def advance(self, req: Request, token: int, pending: int = 0) -> tuple[list[int], str | None]:
        """After `token` was sampled for `req`: (tokens to append, finish reason or None).
        `pending`: tokens before this one that are verified but not yet appended to req.

        Sets req.error when the guide refuses the token (finish reason "error"); the mask makes
        that a bug, but it ends one request, never the batch."""
        guide, vocab = req.constraint, self._vocab
        budget = guide.budget if self.budget_closure else None
        if token in vocab.end_ids:
            if not guide.is_final():  # the mask allows an end only there: a bug, caught for this request
                req.error = "the constraint refused the end of the output before it was complete"
                return [], "error"
            return self._took(req, pending, [token], "stop", budget)
        if not guide.accept(token):
            req.error = f"the constraint refused token {token}: {guide.error}"
            return [], "error"
        if budget is not None:
            start = time.perf_counter()
            swap = guide.after_accept(token, budget - 1)
            self.stats.closure_time += time.perf_counter() - start
            if swap is not None:
                self.stats.replaced_tokens += 1
                guide.closure_acted = True
                token = swap
                if token in vocab.end_ids:
                    return self._took(req, pending, [token], "stop", budget)
        if guide.is_terminated():
            return self._took(req, pending, [token], "stop", budget)
        if not self.enable_jump_forward or req.params.logprobs or req.params.top_logprobs:
            return self._took(req, pending, [token], None, budget)  # logprob requests sample every token
        try:
            tokens = jump_forward.plan(guide, token, vocab, self.encode)
        except RuntimeError as exc:
            req.error = str(exc)
            return [token], "error"
        if tokens is None:
            return self._took(req, pending, [token], None, budget)
        if budget is not None and not self._jump_fits(guide, len(tokens), budget):
            guide.rollback(len(tokens))  # the forced tokens would overrun: sample them instead
            if not guide.accept(token):
                req.error = f"guide refused token {token} it had accepted: {guide.error}"
                return [token], "error"
            self.stats.refused_jumps += 1
            guide.closure_acted = True
            return self._took(req, pending, [token], None, budget)
        self.stats.jumps += 1
        self.stats.forced_tokens += len(tokens) - 1
        return self._took(req, pending, tokens, "stop" if guide.is_terminated() else None, budget)

    def _jump_fits(self, guide: Guide, count: int, budget: int) -> bool:
        start = time.perf_counter()
        fits = count <= budget and guide.completes_within(budget - count)
        self.stats.closure_time += time.perf_counter() - start
        return fits

    def _took(self, req: Request, pending: int, tokens: list[int], reason: str | None,
              budget: int | None) -> tuple[list[int], str | None]:
        """Books the budget: what is left after `tokens`, where closure first acted, and whether
        the request ends knowing that its budget could not be met."""
        if budget is None:
            return tokens, reason
        guide = req.constraint
        guide.budget = budget - len(tokens)
        if guide.closure_acted and not guide.closure_logged:
            guide.closure_logged = True
            self.closure_starts[req.rid] = len(req.output_ids) + pending
            self.stats.closed_requests += 1
            while len(self.closure_starts) > CLOSURE_LOG:
                self.closure_starts.popitem(last=False)
        if reason == "stop":
            if req.error is not None and req.error.startswith("constraint budget:"):
                req.error = None  # complete after all
        elif guide.closure_error is not None and req.error is None:
            req.error = guide.closure_error
        return tokens, reason


# What a guide's trial walk (accept_many, then rollback to where it was) may change besides its
# matcher state, which the rollback restores: the budget closure's cached plans and estimate
# (keyed by a serial that every change bumps) and the flags a hypothetical row's closure sets.
_TRIAL_FIELDS = ("_serial", "_plan", "_before", "_estimate", "closure_acted", "closure_error")


def _trial_state(guide: Guide) -> dict:
    return {name: getattr(guide, name) for name in _TRIAL_FIELDS if hasattr(guide, name)}


def _restore(guide: Guide, saved: dict) -> None:
    for name, value in saved.items():
        setattr(guide, name, value)


def _then(first: Future, start: Callable[[ConstraintSpec], Future]) -> Future:
    """A Future of start(first's result), chained on completion (no thread waits for `first`).
    Cancelled (its request timed out or was aborted), it starts nothing more."""
    out: Future = Future()

    def copy(done: Future) -> None:
        if not out.set_running_or_notify_cancel():
            return
        if done.cancelled() or done.exception() is not None:
            out.set_exception(done.exception() if not done.cancelled() else RuntimeError("cancelled"))
        else:
            out.set_result(done.result())

    def go(checked: Future) -> None:
        if out.cancelled():
            return
        if checked.cancelled() or checked.exception() is not None:
            copy(checked)
        else:
            start(checked.result()).add_done_callback(copy)

    first.add_done_callback(go)
    out.add_done_callback(lambda done: done.cancelled() and first.cancel())  # a queued check: skipped
    return out
