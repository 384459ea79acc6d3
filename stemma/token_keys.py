"""Token-id keys, shared by the engine's radix tree and the gateway's prefix index (torch-free)."""
from __future__ import annotations

from typing import Sequence

Key = tuple[int, ...]


def common_len(edge: Key, key: Sequence[int], start: int) -> int:
    """Length of the common prefix of `edge` and `key[start:]`."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == tuple(key[start:start + n]):  # tuple() of a tuple is the same object
        return n
    i = 0
    while edge[i] == key[start + i]:
        i += 1
    return i
