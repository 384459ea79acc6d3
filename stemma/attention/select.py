"""Choosing an attention backend: `auto` is triton on CUDA and torch elsewhere."""
from __future__ import annotations

import torch

from stemma.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "triton":
        from stemma.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from stemma.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()
