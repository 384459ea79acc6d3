"""KV memory: the slot pool, its allocator, and the request -> slot table.

Page size is 1: a slot holds the K and V of one token in every layer, so any token prefix can be
shared. Slot 0 is never handed out; it is the write target for padding.

Invariant (checked by tests): free slots + slots held by the radix tree + slots held only by
running requests == total.
"""
from __future__ import annotations

import torch


class SlotAllocator:
    """Hands out KV slots 1..total. Slot 0 is reserved for padding."""

    def __init__(self, total: int, device: torch.device | str = "cpu"):
        if total < 1:
            raise ValueError(f"kv pool must hold at least one slot, got {total}")
        self.total = total
        self.device = torch.device(device)
        self._free = torch.arange(1, total + 1, dtype=torch.int64, device=self.device)

    @property
    def available(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots, or None when fewer than n are free (nothing is taken then)."""
        if n > self._free.numel():
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.to(self.device, torch.int64)])

    def reset(self) -> None:
        self._free = torch.arange(1, self.total + 1, dtype=torch.int64, device=self.device)


class KVPool:
    """K and V buffers, `[layers][slots + 1, kv_heads, head_dim]` (row 0 is the padding slot)."""

    def __init__(self, num_layers: int, total_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (total_slots + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = SlotAllocator(total_slots, device)

    @property
    def total_slots(self) -> int:
        return self.allocator.total

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (any shape S), each [*S, kv_heads, head_dim]. index_select of the
        flattened slots: 3-7x faster on CPU than advanced indexing with a 2-D index."""
        flat = slots.reshape(-1)
        tail = self.k[layer].shape[1:]
        return (self.k[layer].index_select(0, flat).view(*slots.shape, *tail),
                self.v[layer].index_select(0, flat).view(*slots.shape, *tail))

    def bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[2] * k.element_size()


class ReqToSlot:
    """`table[row, pos]` is the KV slot of token `pos` of the request that holds `row`.

    For a request of length L in row r, `table[r, 0:L]` are valid; entries past L are stale.
    """

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu"):
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Sets positions [start, start + len(slots)) of `row`."""
        self.table[row, start:start + slots.numel()] = slots.to(torch.int32)

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[row, start:end].to(torch.int64)
