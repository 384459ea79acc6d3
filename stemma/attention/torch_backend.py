"""Attention in plain torch, shaped for CPUs: a KV group's query heads are folded into the rows of
one matmul (measured ~10x faster than scaled_dot_product_attention for one-token decode on CPU).

Prefill scores are taken in the model dtype, decode scores in float32; softmax in float32. Slot indices and masks depend only on
the batch, so `begin` computes them once per forward and every layer reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from stemma.attention.base import AttentionBackend, AttentionLayer
from stemma.executor.forward_batch import ForwardBatch
from stemma.cache.kv_pool import KVPool
from stemma.registry import ATTENTION_BACKENDS


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Mask [..., Q, K]: causal, and within the sliding window when one is set."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def masked_scores(scores: torch.Tensor, mask: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    scores = scores.float() * layer.scale
    if layer.logit_cap:
        scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
    return scores.masked_fill(~mask, float("-inf"))


def softmax_weights(scores: torch.Tensor, mask: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    return torch.softmax(masked_scores(scores, mask, layer), dim=-1)


def attend(scores: torch.Tensor, mask: torch.Tensor, layer: AttentionLayer, v: torch.Tensor) -> torch.Tensor:
    """softmax(masked scores) @ v, over the last dimension of `scores` (the keys; v float32)."""
    if not torch.compiler.is_dynamo_compiling():
        return torch.matmul(softmax_weights(scores, mask, layer), v)
    # In a graph, the softmax's denominator is one more column of the same matmul: Inductor's C++
    # float32 sum over the keys guards on their number (whether it passes its 4,096-long chunk),
    # so a graph with a softmax in it recompiled, inside a step, once a context passed 4,096.
    s = masked_scores(scores, mask, layer)
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    weighted = torch.matmul(e, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1))
    return weighted[..., :-1] / weighted[..., -1:]


@dataclass
class _Part:
    """Requests attended together: their query rows, key slots and positions."""
    tokens: torch.Tensor          # query rows of q: [B] (decode) or [R * E] (extend, padded)
    slots: torch.Tensor           # [B, L] or [R, L]; slots past a request's seq_len are stale
    q_pos: torch.Tensor           # [B, 1] or [R, E]
    k_pos: torch.Tensor           # [B, L] or [R, L]
    masks: dict = field(default_factory=dict)
    take: torch.Tensor | None = None  # extend: the padded rows that are real queries ...
    dest: torch.Tensor | None = None  # ... and the rows of q they belong to

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = visible(self.q_pos, self.k_pos, window)
        return self.masks[window]


def _window_width(full: _Part, window: int) -> int:
    """How many keys `_windowed` gives each request of `full`: min(window + E - 1, L), E the
    queries per row (1 when decoding), L the keys of `full`."""
    return min(window + full.q_pos.shape[1] - 1, full.k_pos.shape[1])


def _windowed(full: _Part, window: int) -> _Part:
    """`full`'s queries against only the keys a sliding window can show them: per request, the
    last `_window_width` positions up to its last query (from 0 while its context is shorter).
    Invariant: every key position visible through the window from any of the request's queries
    is among them, and each is < L."""
    width = _window_width(full, window)
    start = ((full.q_pos[:, -1] + 1) - width).clamp(min=0)
    k_pos = start[:, None] + torch.arange(width, device=start.device)[None, :]
    return replace(full, slots=full.slots.gather(1, k_pos), k_pos=k_pos, masks={})


def extend_groups(prefix_lens: list[int], extend_lens: list[int], slack: int = 1 << 16) -> list[list[int]]:
    """Extending requests (extend_len > 1) in groups that share one padded matmul. Requests are
    sorted by size and a group closes when padding would more than double its score area."""
    order = sorted((i for i, e in enumerate(extend_lens) if e > 1),
                   key=lambda i: (extend_lens[i], prefix_lens[i]))
    groups: list[list[int]] = []
    e_max = s_max = area = 0  # of the open group, groups[-1]
    for i in order:
        e, s = extend_lens[i], prefix_lens[i] + extend_lens[i]
        grown = (len(groups[-1]) + 1) * max(e_max, e) * max(s_max, s) if groups else 0
        if not groups or grown > 2 * (area + e * s) + slack:
            groups.append([])
            e_max = s_max = area = 0
        groups[-1].append(i)
        e_max, s_max, area = max(e_max, e), max(s_max, s), area + e * s
    return groups


@ATTENTION_BACKENDS.register("torch")
class TorchAttentionBackend(AttentionBackend):
    def begin(self, fb: ForwardBatch) -> None:
        super().begin(fb)
        device = fb.input_ids.device
        single = [i for i, e in enumerate(fb.extend_lens_cpu) if e == 1]
        self.decode_part = None
        self.decode_windowed: dict[int, _Part] = {}
        if single:
            idx = torch.tensor(single, dtype=torch.int64, device=device)
            max_len = max(fb.prefix_lens_cpu[i] for i in single) + 1
            k_pos = torch.arange(max_len, device=device)
            self.decode_part = _Part(
                tokens=fb.extend_start[idx],
                slots=fb.req_to_slot[fb.req_rows[idx], :max_len].long(),
                q_pos=(fb.seq_lens[idx] - 1)[:, None],
                k_pos=k_pos[None, :].expand(len(single), -1))
            # made for every window even while the context is shorter than it, so that a compiled
            # graph sees the same inputs before and after the context passes the window
            self.decode_windowed = {w: _windowed(self.decode_part, w) for w in self.windows}
        starts = fb.extend_start.tolist()
        self.extend_parts = [self._extend_part(fb, group, starts, device)
                             for group in extend_groups(fb.prefix_lens_cpu, fb.extend_lens_cpu)]
        # (no graph runs an extend: a window's keys are gathered apart only where they are fewer)
        self.extend_windowed = [{w: _windowed(p, w) for w in self.windows
                                 if _window_width(p, w) < p.k_pos.shape[1]} for p in self.extend_parts]

    @staticmethod
    def _extend_part(fb: ForwardBatch, group: list[int], starts: list[int], device) -> _Part:
        """Request r of the group: padded query row r*E + j is its token j (j < e_r); rows past
        e_r repeat its last token, so every row sees at least one key and none is NaN."""
        pre = [fb.prefix_lens_cpu[i] for i in group]
        ext = [fb.extend_lens_cpu[i] for i in group]
        e_max, s_max = max(ext), max(p + e for p, e in zip(pre, ext))
        j = torch.arange(e_max, device=device)
        last = torch.tensor([e - 1 for e in ext], device=device)[:, None]
        col = torch.minimum(j[None, :], last)                                        # [R, E]
        tokens = (torch.tensor([starts[i] for i in group], device=device)[:, None] + col).reshape(-1)
        real = (j[None, :] <= last).reshape(-1)
        rows = torch.tensor(group, dtype=torch.int64, device=device)
        return _Part(
            tokens=tokens,
            slots=fb.req_to_slot[fb.req_rows[rows], :s_max].long(),
            q_pos=torch.tensor(pre, device=device)[:, None] + col,
            k_pos=torch.arange(s_max, device=device)[None, :].expand(len(group), -1),
            take=real.nonzero().squeeze(1), dest=tokens[real])

    def _decode_part(self, layer: AttentionLayer) -> _Part:
        # a window the backend was not told of: every key, the window masked
        return self.decode_windowed.get(layer.sliding_window, self.decode_part)

    def decode(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        return self._decode_rows(q, self._decode_part(layer), layer, pool)

    def extend(self, q: torch.Tensor, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        out = torch.empty_like(q)
        if self.decode_part is not None:
            tok = self.decode_part.tokens
            out.index_copy_(0, tok, self._decode_rows(q.index_select(0, tok), self._decode_part(layer), layer, pool))
        for part, windowed in zip(self.extend_parts, self.extend_windowed):
            keys = windowed.get(layer.sliding_window, part)
            o = self._extend_group(q.index_select(0, part.tokens), keys, layer, pool)
            out.index_copy_(0, part.dest, o.index_select(0, part.take))
        return out

    @staticmethod
    def _extend_group(q: torch.Tensor, part: _Part, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """q [R*E, Hq, D], padded per request, against the slots of its part (0:L, or a window's)."""
        r, e = part.q_pos.shape
        hkv, d = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // hkv
        k, v = pool.gather(layer.layer_id, part.slots)               # [R, L, Hkv, D]
        k, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)              # [R, Hkv, D, L], [R, Hkv, L, D]
        qg = q.view(r, e, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * e, d)
        mask = part.mask(layer.sliding_window).repeat(1, g, 1)[:, None]  # rows ordered (group, token)
        probs = softmax_weights(torch.matmul(qg, k), mask, layer).to(v.dtype)
        o = torch.matmul(probs, v)                                   # [R, Hkv, G*E, D]
        return o.view(r, hkv, g, e, d).permute(0, 3, 1, 2, 4).reshape(r * e, hkv * g, d)

    @staticmethod
    def _decode_rows(q: torch.Tensor, part: _Part, layer: AttentionLayer, pool: KVPool) -> torch.Tensor:
        """q [B, Hq, D], one query per request at position seq_len-1."""
        b = q.shape[0]
        hkv, d = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // hkv
        k, v = pool.gather(layer.layer_id, part.slots)               # [B, L, Hkv, D]
        # float32 throughout: at one query per request, bf16 batched matmuls cost more than the
        # casts (measured 1.7x slower on the project's CPU), and the probabilities stay exact
        v = v.float().transpose(1, 2)                                # [B, Hkv, L, D]
        return attend(_decode_scores(q, k, hkv, g), part.mask(layer.sliding_window)[:, None], layer,
                      v).reshape(b, hkv * g, d).to(q.dtype)


def _decode_scores(q: torch.Tensor, k: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """q [B, Hkv * G, D] against the gathered keys k [B, L, Hkv, D]: scores [B, Hkv, G, L], float32.

    Eager, a batched matmul over the keys cast to float32. In a graph, a product summed over D
    (a fixed size: nothing guards on L): Inductor then reads each key from the pool inside its
    reduction loop, where the matmul needed the keys gathered and cast into a float32 copy first
    (the compiled one-row step of the default model, by the profiler's graph and bmm time: 1.0-1.7
    ms less at a 4,000-token context, 2.3-2.6 ms at 8,000, 0.2-0.5 ms at 160)."""
    b, d = q.shape[0], q.shape[-1]
    if torch.compiler.is_dynamo_compiling():
        return (k.float().unsqueeze(3) * q.float().view(b, 1, hkv, g, d)).sum(-1).permute(0, 2, 3, 1)
    return torch.matmul(q.float().view(b, hkv, g, d), k.float().permute(0, 2, 3, 1))
