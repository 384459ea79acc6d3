"""Attention with stemma's Triton kernels: the KV write, extend and split-K decode.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch

from stemma.kernels._triton import require_triton
from stemma.kernels.decode_attention import decode_attention
from stemma.kernels.extend_attention import extend_attention
from stemma.kernels.kv_write import kv_write
from stemma.attention.base import AttentionBackend, AttentionLayer
from stemma.executor.forward_batch import ForwardBatch
from stemma.cache.kv_pool import KVPool
from stemma.registry import ATTENTION_BACKENDS


@ATTENTION_BACKENDS.register("triton")
class TritonAttentionBackend(AttentionBackend):
    def __init__(self, windows: tuple[int, ...] = ()):
        require_triton()
        super().__init__(windows)  # the kernels skip the blocks outside a window themselves

    def begin(self, fb: ForwardBatch) -> None:
        super().begin(fb)
        self.max_extend_len = max(fb.extend_lens_cpu, default=0)
        self.max_seq_len = fb.max_seq_len if fb.batch_size else 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                pool: KVPool) -> torch.Tensor:
        # the kernels read the head dim contiguously; CPU projections may hand back transposed views
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        kv_write(k, v, self.fb.out_slots, pool.k[layer.layer_id], pool.v[layer.layer_id])
        if self.is_decode:
            return self.decode(q, layer, pool)
        return self.extend(q, layer, pool)

    def extend(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        fb = self.fb
        return extend_attention(
            q, pool.k[layer.layer_id], pool.v[layer.layer_id], fb.req_to_slot,
            fb.req_rows, fb.prefix_lens, fb.extend_lens, fb.extend_start, layer.scale,
            sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
            max_extend_len=self.max_extend_len)

    def decode(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        fb = self.fb
        return decode_attention(
            q, pool.k[layer.layer_id], pool.v[layer.layer_id], fb.req_to_slot,
            fb.req_rows, fb.seq_lens, layer.scale,
            sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
            max_seq_len=self.max_seq_len)
