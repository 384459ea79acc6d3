"""Choosing an attention backend: `auto` is triton on CUDA and torch elsewhere."""
from __future__ import annotations

import torch

from stemma.attention.base import AttentionBackend
from stemma.registry import ATTENTION_BACKENDS


def make_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    return ATTENTION_BACKENDS.get(name)()
