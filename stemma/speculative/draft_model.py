"""The draft-model drafter (`speculative="draft:<path>"`): a smaller model with the target's
vocabulary, run in this process on the target's device and dtype, with its own KV pool and
req->slot table (its own ModelRunner). It proposes the draft model's greedy tokens, so a draft is
a deterministic function of the request's tokens and verification stays exact.

    propose(reqs, lengths), batched across the requests:
        sync      what the draft pool holds for each request (DraftRow.tokens) against
                  req.tokens: their common prefix stays valid; the rest goes back to the draft
                  pool (drafts the target rejected, and the last fed draft, whose KV was written
                  but never verified)
        room      slots for each request's catch-up and drafts, from the draft pool alone: when
                  it is short, requests not drafting this step give back their draft KV first,
                  then a request gets fewer drafts, or none (the target's cache is never touched)
        catch-up  one extend forward over every request's tokens not yet in the draft pool, its
                  last token included; the logits there give the first draft (a catch-up longer
                  than `chunk` tokens in all first runs in chunks, all but the last tokens)
        decode    max(lengths) - 1 batched decode steps over the requests still drafting, each
                  feeding the previous step's draft and writing its KV

State: one DraftRow per request that has draft KV, in `DraftModelDrafter.rows` keyed by id(req)
(not on req.spec_state, which belongs to Speculation: keeping them here lets the drafter evict
idle rows and check its pool). An entry holds its request, so the id cannot be reused while the
entry lives; `release(req)` (the request finished or was retracted) gives back its row and slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from stemma.executor.forward_batch import ForwardBatch
from stemma.executor.runner import ModelRunner, RunnerConfig

if TYPE_CHECKING:
    from stemma.engine.request import Request
    from stemma.engine_config import EngineConfig
    from stemma.loader.model import LoadedModel

SOURCE = "draft"
PRIOR_ACCEPTANCE = 0.6    # assumed before any draft is verified
CATCH_UP_TOKENS = 2048    # most tokens of one catch-up forward (the engine's chunk size if set)


@dataclass(eq=False)
class DraftRow:
    """A request's draft KV: row `row` of the draft table holds, at positions [0, len(tokens)),
    the slots of `tokens`' KV."""
    req: Request
    row: int
    tokens: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (slice comparisons: the
    mismatch is found by bisection, at C speed)."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftModelDrafter:
    """A non-free drafter (see speculation.Drafter)."""
    free = False
    sources = {SOURCE: PRIOR_ACCEPTANCE}

    def __init__(self, loaded: LoadedModel, config: RunnerConfig, vocab_size: int | None = None,
                 chunk: int = CATCH_UP_TOKENS):
        if vocab_size is not None and loaded.spec.vocab_size != vocab_size:
            raise ValueError(f"draft model {loaded.source!r} has a vocabulary of {loaded.spec.vocab_size} "
                             f"tokens, the target {vocab_size}: a draft model must share the "
                             "target's tokenizer")
        self.runner = ModelRunner(loaded, config)
        self.allocator = self.runner.pool.allocator
        self.table = self.runner.req_to_slot
        self.max_context = self.runner.max_context
        self.chunk = max(chunk, 1)
        self.rows: dict[int, DraftRow] = {}
        self.forwards = 0        # draft forwards run
        self.drafted = 0         # draft tokens proposed

    @classmethod
    def for_engine(cls, path: str, config: EngineConfig, max_context: int,
                   target: ModelRunner | None = None) -> DraftModelDrafter:
        """The drafter of an engine: the draft model loaded on the target runner's device and
        dtype, its vocabulary checked against the target's, a pool and row count the target's.
        Without `target`, device, dtype and sizes come from `config`, and the vocabulary is not
        checked."""
        from stemma.executor import tuning
        from stemma.loader.model import load_model, resolve_dtype
        if target is not None:
            device, dtype, vocab = target.device, target.dtype, target.spec.vocab_size
            pool, rows, backend = (target.config.kv_pool_tokens, target.config.max_running_requests,
                                   target.config.attention_backend)
        else:
            auto = "cuda" if torch.cuda.is_available() else "cpu"
            device = torch.device(auto if config.device == "auto" else config.device)
            dtype, vocab = resolve_dtype(config.dtype, device), None
            pool, rows, backend = config.kv_pool_tokens, config.max_running_requests, config.attention_backend
        loaded = load_model(path, dtype, device, config.quantization, config.int4_group_size)
        tuning.tune(loaded.model)
        runner_config = RunnerConfig(kv_pool_tokens=pool, max_running_requests=rows,
                                     max_context=max_context, attention_backend=backend)
        return cls(loaded, runner_config, vocab, config.chunk_size or CATCH_UP_TOKENS)

    # ---- the Drafter protocol ----
    def propose(self, reqs: list[Request], lengths: list[int]) -> list[tuple[list[int], str]]:
        out: list[tuple[list[int], str]] = [([], SOURCE) for _ in reqs]
        wanted = []  # (index, request, state or None, drafts)
        for i, (req, k) in enumerate(zip(reqs, lengths)):
            k = min(k, self.max_context - len(req.tokens) + 1)  # the last fed draft must fit a row
            if k > 0:
                wanted.append((i, req, self._sync(req), k))
        if not wanted:
            return out
        need = sum(len(req.tokens) - (len(s.tokens) if s else 0) + k - 1 for _, req, s, k in wanted)
        self._evict_idle({id(req) for _, req, _, _ in wanted}, need,
                         sum(s is None for _, _, s, _ in wanted))
        work = []  # (index, request, state, start, drafts): positions [start, len + drafts - 1)
        taken = 0
        for i, req, state, k in wanted:
            start = len(state.tokens) if state is not None else 0
            room = self.allocator.available - taken
            k = min(k, room - (len(req.tokens) - start) + 1)
            if k < 1:
                continue
            if state is None:
                row = self.table.alloc_row()
                if row is None:
                    continue
                state = self.rows[id(req)] = DraftRow(req, row)
            taken += len(req.tokens) - start + k - 1
            work.append((i, req, state, start, k))
        if not work:
            return out
        slots = self.allocator.alloc(taken)
        at = 0
        for _, req, state, start, k in work:
            n = len(req.tokens) - start + k - 1
            self.table.write(state.row, start, slots[at:at + n])
            at += n
        try:
            drafted = self._draft(work)
        except Exception:
            self.allocator.free(slots)  # _draft books its KV in the rows only once all forwards ran
            raise
        for i, drafts in zip((w[0] for w in work), drafted):
            out[i] = (drafts, SOURCE)
        return out

    def release(self, req: Request) -> None:
        state = self.rows.pop(id(req), None)
        if state is not None:
            self.allocator.free(self.table.read(state.row, len(state.tokens)))
            self.table.free_row(state.row)

    # ---- the draft KV ----
    def _sync(self, req: Request) -> DraftRow | None:
        """req's DraftRow (None: it has none yet), holding only KV that matches req.tokens, all
        but its last token at most."""
        state = self.rows.get(id(req))
        if state is None:
            return None
        keep = common_prefix(state.tokens, req.tokens, len(req.tokens) - 1)
        if keep < len(state.tokens):
            self.allocator.free(self.table.read(state.row, len(state.tokens), keep))
            del state.tokens[keep:]
        return state

    def _evict_idle(self, active: set[int], slots: int, rows: int) -> None:
        """Releases the draft KV of requests not drafting now, largest first, until `slots` slots
        and `rows` rows are free (or no idle one is left)."""
        idle = sorted((s for key, s in self.rows.items() if key not in active), key=lambda s: len(s.tokens))
        while idle and (self.allocator.available < slots or self.table.available < rows):
            self.release(idle.pop().req)

    def _draft(self, work: list[tuple[int, Request, DraftRow, int, int]]) -> list[list[int]]:
        """Runs the catch-up and decode forwards of `work` (slots already in the rows); returns
        each one's greedy drafts, and records the KV it wrote in its DraftRow."""
        order = sorted(range(len(work)), key=lambda j: -work[j][4])  # drafting longest first
        items = [work[j] for j in order]
        rows = [state.row for _, _, state, _, _ in items]
        ends = [len(req.tokens) for _, req, _, _, _ in items]
        starts = [start for _, _, _, start, _ in items]
        if sum(e - s for s, e in zip(starts, ends)) > self.chunk:
            self._catch_up_chunks(items, starts, ends)
            starts = [e - 1 for e in ends]
        first = self._forward(rows, starts, [req.tokens[s:e] for (_, req, _, _, _), s, e in
                                             zip(items, starts, ends)])
        steps = [first]
        most = items[0][4]
        for s in range(1, most):  # step s feeds draft s at position len - 1 + s
            active = sum(1 for item in items if item[4] > s)
            steps.append(self._forward(rows[:active], [e - 1 + s for e in ends[:active]],
                                       ids=steps[-1][:active]))
        flat = torch.cat(steps).tolist()
        offsets = [0]
        for t in steps:
            offsets.append(offsets[-1] + t.numel())
        drafts: list[list[int]] = [[] for _ in work]
        for j, (_, req, state, _, k) in enumerate(items):
            tokens = [flat[offsets[s] + j] for s in range(k)]
            state.tokens.extend(req.tokens[len(state.tokens):])
            state.tokens.extend(tokens[:-1])  # every draft's KV but the last one's is written
            drafts[order[j]] = tokens
            self.drafted += k
        return drafts

    def _catch_up_chunks(self, items, starts: list[int], ends: list[int]) -> None:
        """Extends each request's draft KV over positions [start, end - 1), in forwards of at
        most `chunk` tokens."""
        pending = [(state.row, req, s, e - 1) for (_, req, state, _, _), s, e in zip(items, starts, ends)
                   if s < e - 1]
        while pending:
            budget, batch, rest = self.chunk, [], []
            for row, req, s, e in pending:
                n = min(e - s, budget)
                if n > 0:
                    batch.append((row, s, req.tokens[s:s + n]))
                    budget -= n
                if s + n < e:
                    rest.append((row, req, s + n, e))
            self._forward([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
            pending = rest

    def _forward(self, rows: list[int], starts: list[int], token_lists: list[list[int]] | None = None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy next token [B] (on the device) after each request's new tokens, which sit at
        positions [start, start + len) of its row (slots written there already): `token_lists`,
        or one token each from the device tensor `ids` (a decode step, no host round trip)."""
        if token_lists is None:
            token_lists = [[0]] * len(rows)
        lens = [len(t) for t in token_lists]
        device = self.table.table.device
        flat_rows = torch.tensor([r for r, n in zip(rows, lens) for _ in range(n)], device=device)
        flat_pos = torch.tensor([p for s, n in zip(starts, lens) for p in range(s, s + n)], device=device)
        fb = ForwardBatch.build(token_lists=token_lists, req_rows=rows, prefix_lens=starts,
                                out_slots=self.table.table[flat_rows, flat_pos], req_to_slot=self.table.table)
        if ids is not None:
            fb.input_ids = ids
        self.forwards += 1
        return self.runner.forward(fb).argmax(-1)

    # ---- invariants ----
    def held(self) -> int:
        """Slots the draft rows hold."""
        return sum(len(s.tokens) for s in self.rows.values())

    def check_pool_whole(self) -> None:
        """Asserts free + held == total, every held slot distinct, and free + used rows == all."""
        free, held = self.allocator.available, self.held()
        if free + held != self.allocator.total:
            raise AssertionError(f"draft pool not whole: free {free} + held {held} != total "
                                 f"{self.allocator.total}")
        if held:
            slots = torch.cat([self.table.read(s.row, len(s.tokens)) for s in self.rows.values()])
            if torch.unique(slots).numel() != held or bool((slots <= 0).any()):
                raise AssertionError("draft rows share slots, or hold the padding slot")
        if self.table.available + len(self.rows) != self.table.max_reqs:
            raise AssertionError(f"draft rows: {self.table.available} free + {len(self.rows)} held "
                                 f"!= {self.table.max_reqs}")
