"""Verification: every row of a speculating request is sampled as the request would be sampled
at that position, and the drafts are kept up to the first that differs from its row's token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from stemma.engine.request import Request
    from stemma.sampling_params import SamplingParams


@dataclass(frozen=True)
class VirtualRow:
    """The request as it stands at draft position j: its outputs so far plus drafts[:j]. The
    sampler reads only these (penalties, min_new_tokens bans and seeded noise all depend on the
    output so far), so the row samples what a plain decode would sample at that position."""
    params: SamplingParams
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    constraint: None = None


def virtual_rows(req: Request, drafts: list[int]) -> list[VirtualRow]:
    return [VirtualRow(req.params, req.input_ids, req.output_ids + drafts[:j])
            for j in range(len(drafts) + 1)]


def accepted(drafts: list[int], sampled: Sequence[int]) -> list[int]:
    """The drafts up to the first whose row sampled something else, then that row's token (or,
    all accepted, the token sampled after the last draft). len(sampled) == len(drafts) + 1."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return drafts[:a] + [sampled[a]]
