"""The attention-backend interface: `extend` and `decode` over a slot-indexed KV pool.

A backend is created once per model runner. For each forward, `begin(fb)` prepares per-batch
metadata that every layer shares. Each layer then calls `forward`, which writes the new tokens'
K/V into their slots and attends through the req->slot table.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from stemma.executor.forward_batch import ForwardBatch
from stemma.cache.kv_pool import KVPool


@dataclass(frozen=True)
class AttentionLayer:
    """What attention needs to know about one layer."""
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # key at k_pos is visible from q_pos iff q_pos - k_pos < window
    logit_cap: float | None = None     # scores become cap * tanh(scores / cap)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


class AttentionBackend(ABC):
    def __init__(self, windows: tuple[int, ...] = ()):
        # the distinct sliding windows of the model's layers: a backend may prepare per-window
        # metadata in `begin`, once for every layer of that window
        self.windows = tuple(sorted(set(windows)))

    def begin(self, fb: ForwardBatch) -> None:
        """Called once per forward, before the first layer."""
        self.fb = fb
        # a bool, not the list it comes from: a compiled graph then guards on it alone
        self.is_decode = fb.is_decode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                pool: KVPool) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""
        pool.write(layer.layer_id, self.fb.out_slots, k, v)
        if self.is_decode:
            return self.decode(q, layer, pool)
        return self.extend(q, layer, pool)

    @abstractmethod
    def extend(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """Each request's new queries attend causally to its slots 0:seq_len."""

    @abstractmethod
    def decode(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """One query per request ([B, Hq, D]) attends to its slots 0:seq_len."""
