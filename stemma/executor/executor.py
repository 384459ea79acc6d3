"""Runs one planned step: the forward over the mixed batch, the prompt logprobs it asked for, the
constrained rows' masks and sampling. It reads the plan and its requests and changes neither;
the scheduler books the result (see stemma.engine.plan).

A fault of one request's rows fails that request only: rows whose logits hold NaN or inf, a
constraint whose mask raises, prompt logprobs that cannot be scored. It goes into
`StepOutput.failed` and its rows are sampled on harmlessly; the scheduler ends it. A fault of the
whole step (the forward) raises, and `Engine.step` fails the step's requests."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from stemma.engine import faults
from stemma.executor.forward_batch import ForwardBatch
from stemma.sampling.batch import SamplingBatch
from stemma.sampling.sampler import row_major_float
from stemma.speculative.verify import VirtualRow, virtual_rows

if TYPE_CHECKING:
    from stemma.constrained.constrainer import Constrainer
    from stemma.engine.plan import StepPlan
    from stemma.engine.request import Request
    from stemma.executor.runner import ModelRunner
    from stemma.sampling.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What a step computed. The sampled lists have one row per sampled position: request i of
    `plan.sampled` owns `counts[i]` consecutive rows (1, or 1 + its drafts when it speculates;
    `counts` empty: one row each)."""
    token_ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None                            # None: no row asked
    top_logprobs: list[tuple[list[int], list[float]]] | None = None  # (ids, values) per row, k_max
    # plan index -> logprobs of the prompt tokens this step scored (None: none of them was a
    # prompt token), for each request whose prompt logprobs are being computed
    prompt_logprobs: dict[int, list[float] | None] = field(default_factory=dict)
    # plan index -> why the request failed in this step (its other results are not booked)
    failed: dict[int, str] = field(default_factory=dict)


PROMPT_LOGPROB_BLOCK = 256  # prompt positions scored at once: bounds the float32 copy of logits


def wants_more(req: Request, ahead: int = 0) -> bool:
    """Whether `req`, `ahead` tokens past its output so far, must not end yet by an end token: it
    ignores EOS, or has fewer than min_new_tokens (its constraint's end tokens are held too)."""
    return req.params.ignore_eos or len(req.output_ids) + ahead < req.params.min_new_tokens


def fault_text(where: str, exc: BaseException) -> str:
    """req.error of a request failed by an exception `where` (an internal error)."""
    return f"internal error in {where}: {type(exc).__name__}: {exc}"


def prompt_logprobs(req: Request, n: int, logits: torch.Tensor) -> list[float] | None:
    """Logprobs of the prompt tokens whose preceding position is among `logits`' rows (the last
    rows of req's `n` new tokens) from req.logit_start() on, or None when those rows score no
    prompt token. A chunk that ends before the logit start still returns its last row (every
    request's forward returns one): that row is not scored."""
    first = req.kv_len + n - logits.shape[0]      # position of logits[0]
    skip = max(0, (req.logit_start() or 0) - first)
    first += skip
    # the last position whose next token is in the prompt: after a retraction req.tokens holds
    # the outputs too, and the prompt's last position would score the first output token
    prompt_end = len(req.input_ids) - 2
    upto = min(req.kv_len + n, prompt_end + 1) - first
    if upto <= 0:
        return None
    logits = logits[skip:]
    targets = torch.tensor(req.tokens[first + 1:first + 1 + upto], dtype=torch.int64)
    values: list[float] = []
    for at in range(0, upto, PROMPT_LOGPROB_BLOCK):
        block = row_major_float(logits[at:at + PROMPT_LOGPROB_BLOCK][:upto - at])
        if not bool(torch.isfinite(block).all()):
            raise FloatingPointError("the model's logits for its prompt hold NaN or inf")
        ids = targets[at:at + block.shape[0], None].to(block.device)
        values += torch.log_softmax(block, dim=-1).gather(1, ids)[:, 0].tolist()
    return values


class Executor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, constrainer: Constrainer,
                 eos_token_ids: tuple[int, ...]):
        self.runner = runner
        self.sampler = sampler
        self.constrainer = constrainer
        self.eos_token_ids = eos_token_ids

    def run(self, plan: StepPlan) -> StepOutput:
        fb = self.batch(plan)
        if faults.INJECTED is not None:
            faults.INJECTED.fire("forward", plan.reqs)
        logits = self.runner.forward(fb)
        out = StepOutput()
        out.failed.update((i, fault_text("its constraint", exc)) for i, exc in plan.faults.items())
        ends = torch.tensor(fb.logits_counts).cumsum(0).tolist()  # request i's rows end at ends[i]
        rows, sampled, paths = [], [], []
        owners: list[int] = []  # plan index of each sampled row
        for i, (req, n) in enumerate(zip(plan.reqs, plan.counts)):
            if i in plan.drafts:  # every row: each draft position is sampled (verify)
                drafts = plan.drafts[i][0]
                if req.constraint is not None:  # its rows are masked along the drafts' path
                    paths.append((i, drafts, range(len(rows), len(rows) + len(drafts) + 1)))
                rows.extend(range(ends[i] - len(drafts) - 1, ends[i]))
                owners.extend([i] * (len(drafts) + 1))
                sampled.extend(virtual_rows(req, drafts))
                out.counts.append(len(drafts) + 1)
                continue
            if req.logit_start() is not None:
                try:
                    out.prompt_logprobs[i] = prompt_logprobs(
                        req, n, logits[ends[i] - fb.logits_counts[i]:ends[i]])
                except Exception as exc:
                    out.failed[i] = fault_text("prompt logprobs", exc)
            if plan.sample[i]:
                rows.append(ends[i] - 1)
                owners.append(i)
                sampled.append(req)
                out.counts.append(1)
        if rows:
            if len(rows) != logits.shape[0]:
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            logits = self._drop_nonfinite(logits, owners, out)
            for i, drafts, at in paths:
                req = plan.reqs[i]
                try:
                    self.constrainer.mask_path(logits, req.constraint, drafts, at,
                                               [wants_more(req, j) for j in range(len(drafts) + 1)])
                except Exception as exc:
                    out.failed.setdefault(i, fault_text("its constraint", exc))
            self._sample(sampled, logits, owners, out)
        return out

    @staticmethod
    def _drop_nonfinite(logits: torch.Tensor, owners: list[int], out: StepOutput) -> torch.Tensor:
        """The logits with each row holding NaN or inf zeroed, its request failed. A sound
        forward gives finite logits (masks come later), so this is one check per step."""
        # a row's sum is finite iff every entry is (logits are far from overflowing a float32
        # sum; bfloat16 has float32's range and sums in float32 inside): one pass over the
        # 262k-wide rows instead of isfinite's several. Not `dtype=float32` for bfloat16: on CPU
        # that path took 28 ms at 64 rows against 0.6 ms (measured), a third of a step.
        wide = torch.float32 if logits.dtype == torch.float16 else None
        if bool(torch.isfinite(logits.sum(dim=-1, dtype=wide)).all()):
            return logits
        finite = torch.isfinite(logits).all(dim=-1)
        for r in (~finite).nonzero().flatten().tolist():
            out.failed.setdefault(owners[r], "internal error: the model's logits for it hold NaN or inf")
        return torch.where(finite[:, None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))

    def batch(self, plan: StepPlan) -> ForwardBatch:
        req_to_slot = self.runner.req_to_slot
        reqs, counts = plan.reqs, plan.counts
        token_lists, logit_starts = [], []
        for i, (r, n) in enumerate(zip(reqs, counts)):
            if i in plan.drafts:  # the last token, then the drafts: logits at every one
                token_lists.append(r.tokens[r.kv_len:r.kv_len + 1] + plan.drafts[i][0])
                logit_starts.append(r.kv_len)
            else:
                token_lists.append(r.tokens[r.kv_len:r.kv_len + n])
                logit_starts.append(r.logit_start())
        out_slots = torch.cat([req_to_slot.read(r.row, r.kv_len + n, r.kv_len) for r, n in zip(reqs, counts)])
        return ForwardBatch.build(token_lists=token_lists, req_rows=[r.row for r in reqs],
                                  prefix_lens=[r.kv_len for r in reqs], out_slots=out_slots,
                                  req_to_slot=req_to_slot.table, logit_starts=logit_starts)

    def _sample(self, reqs: list[Request | VirtualRow], logits: torch.Tensor, owners: list[int],
                out: StepOutput) -> None:
        # constrained rows only: one bitmask, applied in place; unconstrained rows are not touched
        guided = [i for i, r in enumerate(reqs) if r.constraint is not None]
        if guided:
            self._mask(logits, [reqs[i].constraint for i in guided], guided, owners, out,
                       [wants_more(reqs[i]) for i in guided])
        batch = SamplingBatch.build(reqs, logits.shape[-1], logits.device, eos_token_ids=self.eos_token_ids)
        sampled = self.sampler.sample(logits, batch)
        out.token_ids = sampled.token_ids.tolist()
        if sampled.logprobs is not None:
            out.logprobs = sampled.logprobs.tolist()
        if sampled.top_logprobs is not None:
            tops = sampled.top_logprobs
            out.top_logprobs = list(zip(tops.ids.tolist(), tops.values.tolist()))

    def _mask(self, logits: torch.Tensor, guides: list, rows: list[int], owners: list[int],
              out: StepOutput, hold: list[bool]) -> None:
        """One bitmask for all guided rows; when it fails, each guide alone, so that only the
        requests whose guide fails are failed (masking a row twice is the same as once)."""
        try:
            self.constrainer.mask(logits, guides, rows, hold)
            return
        except Exception as exc:
            logger.warning("a constrained mask failed (%s); masking each guide alone", exc)
        for guide, row, held in zip(guides, rows, hold):
            try:
                self.constrainer.mask(logits, [guide], [row], [held])
            except Exception as exc:
                out.failed.setdefault(owners[row], fault_text("its constraint", exc))
