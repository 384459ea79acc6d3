"""One forward's batch as a flat int64 frame: what rank 0 of a tensor-parallel engine sends its
worker ranks before each forward, so that they run the same forward on their slices.

    [B, T, K, S | input_ids (T) | positions (T) | out_slots (T) | prefix_lens (B) | extend_lens (B)
     | logits_indices (K) | logits_counts (B) | each request's KV slots 0..seq_len (S in all)]

A worker rebuilds the batch over a req->slot table of its own with one row per request (the
slots it reads are the same slot ids: every rank's KV pool has the same slots, each holding the
rank's own KV heads), so rank 0's table, its rows and any allocation state never travel.
"""
from __future__ import annotations

import numpy as np
import torch

from stemma.executor.forward_batch import ForwardBatch

HEADER = 4


def pack(fb: ForwardBatch) -> bytes:
    seq_lens = [p + e for p, e in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu)]
    rows = fb.req_rows.tolist()
    table = fb.req_to_slot.cpu()
    slots = torch.cat([table[r, :n].long() for r, n in zip(rows, seq_lens)]) if rows else torch.empty(0)
    parts = [torch.tensor([fb.batch_size, fb.num_tokens, fb.logits_indices.numel(), slots.numel()]),
             fb.input_ids.cpu(), fb.positions.cpu(), fb.out_slots.cpu(), fb.prefix_lens.cpu(),
             fb.extend_lens.cpu(), fb.logits_indices.cpu(), torch.tensor(fb.logits_counts), slots]
    return torch.cat([p.long() for p in parts]).numpy().tobytes()


def unpack(frame: bytes, device: torch.device) -> ForwardBatch:
    flat = torch.from_numpy(np.frombuffer(frame, dtype=np.int64).copy())
    b, t, k, s = flat[:HEADER].tolist()
    sizes = [t, t, t, b, b, k, b, s]
    input_ids, positions, out_slots, prefix, extend, logits_idx, counts, slots = \
        torch.split(flat[HEADER:], sizes)
    prefix_cpu, extend_cpu = prefix.tolist(), extend.tolist()
    seq = [p + e for p, e in zip(prefix_cpu, extend_cpu)]
    table = torch.zeros((b, max(seq, default=1)), dtype=torch.int32)
    offset = 0
    for i, n in enumerate(seq):
        table[i, :n] = slots[offset:offset + n].to(torch.int32)
        offset += n
    starts = torch.tensor([sum(extend_cpu[:i]) for i in range(b)], dtype=torch.int64)

    def on(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    return ForwardBatch(input_ids=on(input_ids), positions=on(positions), out_slots=on(out_slots),
                        req_rows=on(torch.arange(b)), prefix_lens=on(prefix), extend_lens=on(extend),
                        seq_lens=on(torch.tensor(seq, dtype=torch.int64)), extend_start=on(starts),
                        req_to_slot=on(table), logits_indices=on(logits_idx),
                        logits_counts=counts.tolist(), prefix_lens_cpu=prefix_cpu,
                        extend_lens_cpu=extend_cpu)
