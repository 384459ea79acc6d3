"""The sampling options of one decoding step, as device tensors: one row per request.

Built once per step by `SamplingBatch.build` from the running requests, in the same row order as
the logits the model returns. Only host-side lists are read while building, so building never
waits on the device. Tensors a step does not need are None: penalty counts exist only for the rows
that use penalties, Gumbel seeds only for the seeded rows, bans only when something is banned.

Penalty counts are rebuilt from the token lists on every step, at a cost proportional to the
tokens of the penalized requests only (zero when no request uses penalties).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from stemma.sampling_params import SamplingParams

TEMPERATURE_BOUND = 1e30  # a higher temperature is taken as this one (past float32's max it was inf)


class SamplingRequest(Protocol):
    """What the sampler reads from a request."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def input_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...  # tokens generated so far


@dataclass(frozen=True)
class Penalties:
    """Penalty inputs of the P rows that use penalties (compact: row i of these is rows[i])."""
    rows: torch.Tensor         # [P] int64, rows of the batch
    repetition: torch.Tensor   # [P] float32
    frequency: torch.Tensor    # [P] float32
    presence: torch.Tensor     # [P] float32
    seen: torch.Tensor         # [P, V] bool, token occurs in prompt or output
    counts: torch.Tensor       # [P, V] float32, occurrences in the output


@dataclass(frozen=True)
class SeededRows:
    """The S rows that sample with counter-based noise (see seeded_noise)."""
    rows: torch.Tensor   # [S] int64
    seeds: torch.Tensor  # [S] int64
    steps: torch.Tensor  # [S] int64, tokens the request has generated so far


@dataclass(frozen=True)
class SamplingBatch:
    vocab_size: int
    temperatures: torch.Tensor        # [B] float32; 1.0 on greedy rows (they never divide by it)
    greedy: torch.Tensor              # [B] bool
    top_k: torch.Tensor               # [B] int64; vocab_size where off
    top_p: torch.Tensor               # [B] float32
    min_p: torch.Tensor               # [B] float32
    filter_rows: torch.Tensor | None  # [F] int64, non-greedy rows with top_k or top_p on
    penalties: Penalties | None
    seeded: SeededRows | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids), both [N] int64
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # logit_bias: (rows, token ids,
                                                                  # values), each [M]
    # host-side facts, so the sampler picks its path without device syncs
    batch_size: int
    all_greedy: bool
    any_min_p: bool
    max_top_logprobs: int
    need_logprobs: bool  # some row asked for logprobs or top_logprobs

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.temperatures.shape != (self.batch_size,):
            raise ValueError(f"temperatures must have shape ({self.batch_size},), "
                             f"got {tuple(self.temperatures.shape)}")

    @classmethod
    def build(cls, requests: Sequence[SamplingRequest], vocab_size: int,
              device: torch.device | str = "cpu", *, eos_token_ids: Sequence[int] = (),
              banned_ids: Sequence[Sequence[int]] | None = None) -> "SamplingBatch":
        """The batch for one step over `requests`, in logits row order.

        A request with fewer than `params.min_new_tokens` output tokens has its
        `params.stop_token_ids` and (unless `ignore_eos`) `eos_token_ids` banned. `banned_ids[i]`
        adds more token ids that row i must not sample.
        """
        params = [r.params for r in requests]
        if banned_ids is not None and len(banned_ids) != len(requests):
            raise ValueError(f"banned_ids must have one entry per request ({len(requests)}), "
                             f"got {len(banned_ids)}")
        greedy = [p.is_greedy for p in params]
        floats = torch.tensor([[1.0 if g else min(p.temperature, TEMPERATURE_BOUND) for p, g in zip(params, greedy)],
                               [p.top_p for p in params],
                               [p.min_p for p in params]], dtype=torch.float32).to(device)
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        filter_rows = [i for i, p in enumerate(params)
                       if not greedy[i] and (top_k[i] < vocab_size or p.top_p < 1.0)]
        return cls(
            vocab_size=vocab_size,
            temperatures=floats[0], top_p=floats[1], min_p=floats[2],
            greedy=torch.tensor(greedy, dtype=torch.bool).to(device),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(device),
            filter_rows=_index_or_none(filter_rows, device),
            penalties=_build_penalties(requests, vocab_size, device),
            seeded=_build_seeded(requests, greedy, device),
            banned=_build_bans(requests, vocab_size, device, eos_token_ids, banned_ids),
            bias=_build_bias(requests, vocab_size, device),
            batch_size=len(requests),
            all_greedy=all(greedy),
            any_min_p=any(p.min_p > 0 and not g for p, g in zip(params, greedy)),
            max_top_logprobs=min(max((p.top_logprobs for p in params), default=0), vocab_size),
            need_logprobs=any(p.logprobs or p.top_logprobs for p in params),
        )


def _index_or_none(rows: list[int], device) -> torch.Tensor | None:
    return torch.tensor(rows, dtype=torch.int64).to(device) if rows else None


def _token_tensor(ids: list[int], vocab_size: int, what: str) -> torch.Tensor:
    """A CPU int64 tensor of token ids, checked to lie in [0, vocab_size)."""
    tensor = torch.tensor(ids, dtype=torch.int64)
    if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab_size):
        raise ValueError(f"{what} holds token ids outside [0, {vocab_size}): "
                         f"min {int(tensor.min())}, max {int(tensor.max())}")
    return tensor


def _build_penalties(requests: Sequence[SamplingRequest], vocab_size: int,
                     device) -> Penalties | None:
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not rows:
        return None
    seen_rows, seen_ids, out_rows, out_ids = [], [], [], []
    for compact, i in enumerate(rows):
        req = requests[i]
        seen_ids += req.input_ids
        seen_ids += req.output_ids
        seen_rows += [compact] * (len(req.input_ids) + len(req.output_ids))
        out_ids += req.output_ids
        out_rows += [compact] * len(req.output_ids)
    # only the flat token lists cross to the device; the [P, V] tensors are filled there
    seen_at = (torch.tensor(seen_rows, dtype=torch.int64).to(device),
               _token_tensor(seen_ids, vocab_size, "input_ids/output_ids").to(device))
    out_at = (torch.tensor(out_rows, dtype=torch.int64).to(device),
              _token_tensor(out_ids, vocab_size, "output_ids").to(device))
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    seen[seen_at] = True
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_(out_at, torch.ones(len(out_ids), device=device), accumulate=True)
    values = torch.tensor([[requests[i].params.repetition_penalty for i in rows],
                           [requests[i].params.frequency_penalty for i in rows],
                           [requests[i].params.presence_penalty for i in rows]],
                          dtype=torch.float32).to(device)
    return Penalties(rows=torch.tensor(rows, dtype=torch.int64).to(device),
                     repetition=values[0], frequency=values[1], presence=values[2],
                     seen=seen, counts=counts)


def _build_seeded(requests: Sequence[SamplingRequest], greedy: list[bool],
                  device) -> SeededRows | None:
    rows = [i for i, r in enumerate(requests) if r.params.seed is not None and not greedy[i]]
    if not rows:
        return None
    values = torch.tensor([[i for i in rows],
                           [requests[i].params.seed for i in rows],
                           [len(requests[i].output_ids) for i in rows]],
                          dtype=torch.int64).to(device)
    return SeededRows(rows=values[0], seeds=values[1], steps=values[2])


def _build_bias(requests: Sequence[SamplingRequest], vocab_size: int, device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows, ids, values = [], [], []
    for i, req in enumerate(requests):
        for token, bias in req.params.logit_bias:
            rows.append(i)
            ids.append(token)
            values.append(bias)
    if not ids:
        return None
    return (torch.tensor(rows, dtype=torch.int64).to(device),
            _token_tensor(ids, vocab_size, "logit_bias token ids").to(device),
            torch.tensor(values, dtype=torch.float32).to(device))


def _build_bans(requests: Sequence[SamplingRequest], vocab_size: int, device,
                eos_token_ids: Sequence[int], banned_ids: Sequence[Sequence[int]] | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows, ids = [], []
    for i, req in enumerate(requests):
        row_ids = list(banned_ids[i]) if banned_ids is not None else []
        p = req.params
        if len(req.output_ids) < p.min_new_tokens:
            row_ids += p.stop_token_ids
            if not p.ignore_eos:
                row_ids += eos_token_ids
        rows += [i] * len(row_ids)
        ids += row_ids
    if not ids:
        return None
    return (torch.tensor(rows, dtype=torch.int64).to(device),
            _token_tensor(ids, vocab_size, "banned token ids").to(device))
