"""Attention in plain torch, shaped for CPUs: a KV group's query heads are folded into the rows of
one matmul (measured ~10x faster than scaled_dot_product_attention for one-token decode on CPU).

Scores are taken in the model dtype, softmax in float32.
"""
from __future__ import annotations

import torch

from stemma.runtime.attention.base import AttentionBackend, AttentionLayer
from stemma.runtime.forward_batch import ForwardBatch
from stemma.runtime.memory import KVPool


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Mask [..., Q, K]: causal, and within the sliding window when one is set."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def softmax_weights(scores: torch.Tensor, mask: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    scores = scores.float() * layer.scale
    if layer.logit_cap:
        scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


class TorchAttentionBackend(AttentionBackend):
    def begin(self, fb: ForwardBatch) -> None:
        super().begin(fb)
        single = [i for i, e in enumerate(fb.extend_lens_cpu) if e == 1]
        self.single = torch.tensor(single, dtype=torch.int64, device=fb.input_ids.device)
        self.multi = [i for i, e in enumerate(fb.extend_lens_cpu) if e > 1]

    def decode(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        fb = self.fb
        return self._decode_rows(q, fb.req_rows, fb.seq_lens, max(fb.prefix_lens_cpu) + 1, layer, pool)

    def extend(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        fb = self.fb
        out = torch.empty_like(q)
        if self.single.numel():
            tok = fb.extend_start[self.single]
            max_len = max(fb.prefix_lens_cpu[i] for i in self.single.tolist()) + 1
            out[tok] = self._decode_rows(q[tok], fb.req_rows[self.single], fb.seq_lens[self.single],
                                         max_len, layer, pool)
        starts = fb.extend_start.tolist() if self.multi else []
        for i in self.multi:
            s, p, e = starts[i], fb.prefix_lens_cpu[i], fb.extend_lens_cpu[i]
            out[s:s + e] = self._extend_one(q[s:s + e], int(fb.req_rows[i]), p, e, layer, pool)
        return out

    def _extend_one(self, q: torch.Tensor, row: int, prefix: int, n: int, layer: AttentionLayer,
                    pool: KVPool) -> torch.Tensor:
        """q [n, Hq, D] at positions prefix..prefix+n-1 against the row's slots 0:prefix+n."""
        hkv, d = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // hkv
        slots = self.fb.req_to_slot[row, :prefix + n].long()
        k = pool.k[layer.layer_id][slots].permute(1, 2, 0)           # [Hkv, D, L]
        v = pool.v[layer.layer_id][slots].transpose(0, 1)            # [Hkv, L, D]
        qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
        q_pos = torch.arange(prefix, prefix + n, device=q.device)
        k_pos = torch.arange(prefix + n, device=q.device)
        mask = visible(q_pos, k_pos, layer.sliding_window).repeat(g, 1)  # rows ordered (group, token)
        probs = softmax_weights(torch.matmul(qg, k), mask, layer).to(v.dtype)
        o = torch.matmul(probs, v)                                   # [Hkv, G*n, D]
        return o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g, d)

    def _decode_rows(self, q: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                     layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """q [B, Hq, D], one query per request at position seq_len-1; keys padded to max_len."""
        b = q.shape[0]
        hkv, d = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // hkv
        slots = self.fb.req_to_slot[rows, :max_len].long()          # [B, L]; past seq_len: stale
        k = pool.k[layer.layer_id][slots].permute(0, 2, 3, 1)        # [B, Hkv, D, L]
        v = pool.v[layer.layer_id][slots].transpose(1, 2)            # [B, Hkv, L, D]
        k_pos = torch.arange(max_len, device=q.device)
        q_pos = (seq_lens - 1)[:, None]                              # [B, 1]
        mask = visible(q_pos, k_pos[None, :].expand(b, -1), layer.sliding_window)  # [B, 1, L]
        scores = torch.matmul(q.view(b, hkv, g, d), k)               # [B, Hkv, G, L]
        probs = softmax_weights(scores, mask[:, None], layer).to(v.dtype)
        return torch.matmul(probs, v).reshape(b, hkv * g, d)
