"""Choosing an attention backend: `auto` is triton on CUDA and torch elsewhere."""
from __future__ import annotations

import torch

from stemma.attention.base import AttentionBackend
from stemma.registry import ATTENTION_BACKENDS


def make_attention_backend(name: str, device: torch.device | str,
                           windows: tuple[int | None, ...] = ()) -> AttentionBackend:
    """`windows`: the layers' sliding windows (None for a layer of full attention)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    return ATTENTION_BACKENDS.get(name)(tuple(w for w in windows if w is not None))
