"""The metadata of one model forward over a flattened, variable-length batch.

Request i of a batch owns row `req_rows[i]` of the req->slot table and has `prefix_lens[i]`
tokens already in the KV pool. This forward extends it by `extend_lens[i]` new tokens:

    position:   0 ............ prefix_len-1 | prefix_len ........ seq_len-1
    req_to_slot row:  cached slots (read)    | out_slots (written this step, then read)
    flat index:                                extend_start .. extend_start+extend_len-1

The caller writes the new tokens' slots into the req->slot table before the forward; attention
writes their K/V into those slots and then reads the whole row `0:seq_len`.
Decoding is extending by one token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor       # [T] int64, the new tokens of every request, concatenated
    positions: torch.Tensor       # [T] int64
    out_slots: torch.Tensor       # [T] int64, KV slot of each new token
    req_rows: torch.Tensor        # [B] int64, rows of req_to_slot
    prefix_lens: torch.Tensor     # [B] int64
    extend_lens: torch.Tensor     # [B] int64
    seq_lens: torch.Tensor        # [B] int64, prefix_lens + extend_lens
    extend_start: torch.Tensor    # [B] int64, offset of request i's first new token in [T]
    req_to_slot: torch.Tensor     # [max_reqs, max_context] int32, the whole table
    logits_indices: torch.Tensor  # [K] int64, flat token indices whose logits are returned
    logits_counts: list[int]      # per request, how many of logits_indices are its own
    # host copies, so backends can plan without device syncs
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu))

    @classmethod
    def on_padding_slot(cls, rows: int, context: int, prefill: int = 0) -> "ForwardBatch":
        """A synthetic batch for warm-ups and compiles: `rows` requests decoding at position
        `context` and one prefilling `prefill` tokens, over a table of their own whose every
        entry is KV slot 0, the padding slot no request holds (so nothing real is read or written)."""
        tokens = [[0]] * rows + ([[0] * prefill] if prefill else [])
        return cls.build(token_lists=tokens, req_rows=list(range(len(tokens))),
                         prefix_lens=[context] * rows + ([0] if prefill else []),
                         out_slots=torch.zeros(rows + prefill, dtype=torch.int64),
                         req_to_slot=torch.zeros((len(tokens), max(context + 1, prefill)), dtype=torch.int32))

    @classmethod
    def build(cls, *, token_lists: Sequence[Sequence[int]], req_rows: Sequence[int],
              prefix_lens: Sequence[int], out_slots: torch.Tensor, req_to_slot: torch.Tensor,
              logit_starts: Sequence[int | None] | None = None) -> "ForwardBatch":
        """Builds the metadata of one forward.

        `token_lists[i]` are request i's new tokens. `logit_starts[i]`, when set, asks for logits
        at every new position >= that absolute position (prompt logprobs); otherwise only the last
        new token of the request gets logits.
        """
        device = req_to_slot.device
        extend_lens = [len(t) for t in token_lists]
        if any(e == 0 for e in extend_lens):
            raise ValueError("every request in a forward needs at least one new token")
        if out_slots.numel() != sum(extend_lens):
            raise ValueError("out_slots must hold one slot per new token")
        starts, offset = [], 0
        positions, logit_idx, counts = [], [], []
        starts_by_req = logit_starts or [None] * len(token_lists)
        for p, e, lstart in zip(prefix_lens, extend_lens, starts_by_req):
            starts.append(offset)
            positions.extend(range(p, p + e))
            first = e - 1 if lstart is None else min(max(lstart - p, 0), e - 1)
            logit_idx.extend(range(offset + first, offset + e))
            counts.append(e - first)
            offset += e

        def t(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            input_ids=t([tok for toks in token_lists for tok in toks]),
            positions=t(positions),
            out_slots=out_slots.to(device, torch.int64),
            req_rows=t(list(req_rows)),
            prefix_lens=t(list(prefix_lens)),
            extend_lens=t(extend_lens),
            seq_lens=t([p + e for p, e in zip(prefix_lens, extend_lens)]),
            extend_start=t(starts),
            req_to_slot=req_to_slot,
            logits_indices=t(logit_idx),
            logits_counts=counts,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=extend_lens,
        )
