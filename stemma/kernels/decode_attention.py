"""Decode attention: one query per request over its slots 0 .. seq_len - 1, split-K.

Request b's query sits at position seq_len[b] - 1, so every key up to it is causally visible; a
sliding window W leaves keys seq_len - W .. seq_len - 1. Scores and soft-cap are as in
`extend_attention`.

Flash-decoding, in two kernels:
  1. Each (request, KV head, split) program takes one contiguous part of the visible key range and
     the query heads that share the KV head (padded to BLOCK_H rows, so a GQA group is one tl.dot).
     It writes its normalized partial output and its logsumexp; an empty split writes lse = -inf.
  2. Each (request, query head) program merges the splits, weighting each by exp(lse - max lse).
"""
from __future__ import annotations

import torch

from stemma.kernels._triton import cast, cdiv, check_launchable, dot, is_interpreted, jit, next_pow2, tl
from stemma.kernels.extend_attention import (check_attention_args, check_per_request,
                                             extend_attention_reference, soft_cap)


@jit
def _decode_split_kernel(
        q_ptr, k_buf_ptr, v_buf_ptr, table_ptr, req_rows_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
        stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_table,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        scale, logit_cap, sliding_window, group, head_dim, num_splits,
        HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, INTERPRETED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < group
    heads = kv_head * group + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # a finite floor, as in extend
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_mask = k_pos < end
        slots = tl.load(table_ptr + row * stride_table + k_pos, mask=k_mask, other=0).to(tl.int64)
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_buf_ptr + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), INTERPRETED) * scale
        if HAS_CAP:
            s = soft_cap(s, logit_cap)
        s = tl.where(k_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_buf_ptr + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERPRETED), v, INTERPRETED)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part_ptr = part_out_ptr + req * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    tl.store(part_ptr + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + req * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, o_ptr,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         head_dim, num_splits,
                         INTERPRETED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(part_lse_ptr + req * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # some split has keys, so the max is finite
    part_ptr = part_out_ptr + req * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
    part = tl.load(part_ptr + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    out = cast(out, o_ptr.dtype.element_ty, INTERPRETED)
    tl.store(o_ptr + req * stride_ob + head * stride_oh + offs_d, out, mask=d_mask)


def default_num_splits(max_seq_len: int) -> int:
    """About 256 keys per split, at most 16 splits."""
    return max(1, min(16, cdiv(max_seq_len, 256)))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_slot: torch.Tensor,
                     req_rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, logit_cap: float | None = None,
                     max_seq_len: int | None = None, num_splits: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k_buf, v_buf [S, Hkv, D]; req_to_slot [R, C]; req_rows, seq_lens [B] (>= 1).

    Returns [B, Hq, D]. `num_splits` defaults from `max_seq_len` (a host int; without it, it is read
    from seq_lens, a sync).
    """
    check_launchable(_decode_split_kernel, q, k_buf, v_buf, req_to_slot, req_rows, seq_lens)
    check_attention_args(q, k_buf, v_buf, req_to_slot, sliding_window, logit_cap)
    batch = check_per_request(req_rows, seq_lens)
    if q.shape[0] != batch:
        raise ValueError(f"decode takes one query per request: q {tuple(q.shape)}, batch {batch}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buf.shape[1]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(int(seq_lens.max()) if max_seq_len is None else max_seq_len)
    group = num_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    block_n = block_n or (32 if block_d > 128 else 64)
    part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_slot, req_rows, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_slot.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        scale, logit_cap or 0.0, sliding_window or 0, group, head_dim, num_splits,
        HAS_CAP=logit_cap is not None, HAS_WINDOW=sliding_window is not None,
        INTERPRETED=is_interpreted(_decode_split_kernel),
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        head_dim, num_splits,
        INTERPRETED=is_interpreted(_decode_merge_kernel), BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
    )
    return out


def decode_attention_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                               req_to_slot: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, sliding_window: int | None = None,
                               logit_cap: float | None = None) -> torch.Tensor:
    """Decoding is extending by one token: the extend reference with extend_len 1."""
    ones = torch.ones_like(seq_lens)
    starts = torch.arange(seq_lens.numel(), device=seq_lens.device)
    return extend_attention_reference(q, k_buf, v_buf, req_to_slot, req_rows, seq_lens - 1, ones, starts,
                                      scale, sliding_window, logit_cap)
