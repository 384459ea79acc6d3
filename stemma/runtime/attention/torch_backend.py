"""Attention in plain torch, shaped for CPUs: a KV group's query heads are folded into the rows of
one matmul (measured ~10x faster than scaled_dot_product_attention for one-token decode on CPU).

Scores are taken in the model dtype, softmax in float32. Slot indices and masks depend only on
the batch, so `begin` computes them once per forward and every layer reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class _Part:
    """Requests attended together: their query rows, key slots and positions."""
    tokens: torch.Tensor | slice  # query rows of q
    slots: torch.Tensor           # [B, L] (decode) or [L] (one extend request)
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = visible(self.q_pos, self.k_pos, window)
        return self.masks[window]


class TorchAttentionBackend(AttentionBackend):
    def begin(self, fb: ForwardBatch) -> None:
        super().begin(fb)
        device = fb.input_ids.device
        single = [i for i, e in enumerate(fb.extend_lens_cpu) if e == 1]
        self.decode_part = None
        if single:
            idx = torch.tensor(single, dtype=torch.int64, device=device)
            max_len = max(fb.prefix_lens_cpu[i] for i in single) + 1
            k_pos = torch.arange(max_len, device=device)
            self.decode_part = _Part(  # keys padded to max_len; slots past seq_len are stale
                tokens=fb.extend_start[idx],
                slots=fb.req_to_slot[fb.req_rows[idx], :max_len].long(),
                q_pos=(fb.seq_lens[idx] - 1)[:, None],
                k_pos=k_pos[None, :].expand(len(single), -1))
        self.extend_parts = []
        starts = fb.extend_start.tolist()
        rows = fb.req_rows.tolist()
        for i, (p, e) in enumerate(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu)):
            if e > 1:
                self.extend_parts.append(_Part(
                    tokens=slice(starts[i], starts[i] + e),
                    slots=fb.req_to_slot[rows[i], :p + e].long(),
                    q_pos=torch.arange(p, p + e, device=device),
                    k_pos=torch.arange(p + e, device=device)))

    def decode(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        return self._decode_rows(q, self.decode_part, layer, pool)

    def extend(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        out = torch.empty_like(q)
        if self.decode_part is not None:
            tok = self.decode_part.tokens
            out[tok] = self._decode_rows(q[tok], self.decode_part, layer, pool)
        for part in self.extend_parts:
            out[part.tokens] = self._extend_one(q[part.tokens], part, layer, pool)
        return out

    @staticmethod
    def _extend_one(q: torch.Tensor, part: _Part, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """q [n, Hq, D] of one request against its slots 0:seq_len."""
        n = q.shape[0]
        hkv, d = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // hkv
        k = pool.k[layer.layer_id][part.slots].permute(1, 2, 0)      # [Hkv, D, L]
        v = pool.v[layer.layer_id][part.slots].transpose(0, 1)       # [Hkv, L, D]
        qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
        mask = part.mask(layer.sliding_window).repeat(g, 1)          # rows ordered (group, token)
        probs = softmax_weights(torch.matmul(qg, k), mask, layer).to(v.dtype)
        o = torch.matmul(probs, v)                                   # [Hkv, G*n, D]
        return o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g, d)

    @staticmethod
    def _decode_rows(q: torch.Tensor, part: _Part, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """q [B, Hq, D], one query per request at position seq_len-1."""
        b = q.shape[0]
        hkv, d = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // hkv
        k = pool.k[layer.layer_id][part.slots].permute(0, 2, 3, 1)   # [B, Hkv, D, L]
        v = pool.v[layer.layer_id][part.slots].transpose(1, 2)       # [B, Hkv, L, D]
        scores = torch.matmul(q.view(b, hkv, g, d), k)               # [B, Hkv, G, L]
        probs = softmax_weights(scores, part.mask(layer.sliding_window)[:, None], layer).to(v.dtype)
        return torch.matmul(probs, v).reshape(b, hkv * g, d)
