"""A minimal request driver over ModelRunner for model-level tests (no scheduler)."""
from __future__ import annotations

import torch

from stemma.executor.runner import ModelRunner


class Driver:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.lens: dict[int, int] = {}

    def new(self) -> int:
        row = self.runner.req_to_slot.alloc_row()
        self.lens[row] = 0
        return row

    def step(self, items: list[tuple[int, list[int]]], all_logits: bool = False) -> list[torch.Tensor]:
        """items: (row, new tokens). Returns each request's logits ([n, V] if all_logits else [1, V])."""
        rows = [r for r, _ in items]
        prefix = [self.lens[r] for r in rows]
        toks = [t for _, t in items]
        starts = [p if all_logits else None for p in prefix]
        fb = self.runner.prepare(toks, rows, prefix, logit_starts=starts)
        logits = self.runner.forward(fb)
        for r, t in items:
            self.lens[r] += len(t)
        return list(logits.split(fb.logits_counts))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        row = self.new()
        out, nxt = [], prompt
        for _ in range(n):
            tok = int(self.step([(row, nxt)])[0][-1].argmax())
            out.append(tok)
            nxt = [tok]
        return out
