"""Extend (prefill) attention over the slot-indexed KV pool, varlen across the batch.

Request i's new queries are rows extend_start[i] .. extend_start[i] + extend_len[i] - 1 of q, at
positions prefix_len[i] .. seq_len[i] - 1. They attend causally to the request's keys at positions
0 .. seq_len[i] - 1, read through `req_to_slot[req_rows[i], pos]`: the cached prefix and the new
tokens alike (the new K/V are written to the pool before attention runs).

A key at k_pos is visible from q_pos iff k_pos <= q_pos and, with a sliding window W,
q_pos - k_pos < W. Scores are `scale * q.k`, soft-capped to `cap * tanh(s / cap)` when a cap is
set, and normalized by an online softmax in fp32.

One program takes BLOCK_M queries of one request and one query head. It walks the visible key range
in BLOCK_N steps, gathering each step's slots from the table. head_dim is padded to a power of two
(BLOCK_D); the padded lanes load as zeros, so they add nothing to q.k, and are never stored.
"""
from __future__ import annotations

import torch

from stemma.kernels._triton import (cast, cdiv, check_int_vector, check_last_dim_contiguous, check_launchable,
                                    dot, is_interpreted, jit, next_pow2, tl)


@jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), with tanh(x) = 2 * sigmoid(2x) - 1."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@jit
def _extend_attention_kernel(
        q_ptr, k_buf_ptr, v_buf_ptr, o_ptr, table_ptr,
        req_rows_ptr, prefix_lens_ptr, extend_lens_ptr, extend_start_ptr,
        stride_qt, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ot, stride_oh,
        stride_table,
        scale, logit_cap, sliding_window, group, head_dim,
        HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, INTERPRETED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + req)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + req)
    seq_len = prefix_len + extend_len
    first_tok = tl.load(extend_start_ptr + req).to(tl.int64)
    row = tl.load(req_rows_ptr + req).to(tl.int64)
    kv_head = head // group

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < extend_len
    q_pos = prefix_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + (first_tok + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    # The running max starts at a finite floor, not -inf: a row whose keys in a block are all masked
    # (scores -inf) then gets exp(-inf - floor) = 0, not exp(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)  # past the block's last query
    lo = 0
    if HAS_WINDOW:  # the first key the block's first query sees, rounded down to a block
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_mask = k_pos < seq_len
        slots = tl.load(table_ptr + row * stride_table + k_pos, mask=k_mask, other=0).to(tl.int64)
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_buf_ptr + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), INTERPRETED) * scale
        if HAS_CAP:
            s = soft_cap(s, logit_cap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_buf_ptr + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype, INTERPRETED), v, INTERPRETED)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (first_tok + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             cast(out, o_ptr.dtype.element_ty, INTERPRETED), mask=m_mask[:, None] & d_mask[None, :])


def check_attention_args(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         req_to_slot: torch.Tensor, sliding_window: int | None,
                         logit_cap: float | None) -> None:
    """Raises unless the shared arguments are what both attention launchers need."""
    if q.dim() != 3 or k_buf.dim() != 3:
        raise ValueError(f"q must be [tokens, Hq, D] and the buffers [slots, Hkv, D], got q "
                         f"{tuple(q.shape)} and k_buf {tuple(k_buf.shape)}")
    if k_buf.shape != v_buf.shape:
        raise ValueError(f"k_buf {tuple(k_buf.shape)} and v_buf {tuple(v_buf.shape)} differ")
    if k_buf.dtype != v_buf.dtype or q.dtype != k_buf.dtype:
        raise TypeError(f"q, k_buf and v_buf must share a dtype, got {q.dtype}, {k_buf.dtype}, {v_buf.dtype}")
    if q.shape[2] != k_buf.shape[2]:
        raise ValueError(f"head_dim of q {q.shape[2]} != the buffers' {k_buf.shape[2]}")
    if q.shape[1] % k_buf.shape[1]:
        raise ValueError(f"Hq {q.shape[1]} is not a multiple of Hkv {k_buf.shape[1]}")
    check_last_dim_contiguous("head_dim", q, k_buf, v_buf)
    if req_to_slot.is_floating_point():
        raise TypeError(f"req_to_slot must hold integers, got {req_to_slot.dtype}")
    if req_to_slot.dim() != 2 or req_to_slot.stride(-1) != 1:
        raise ValueError(f"req_to_slot must be a row-major [R, C] table, got {tuple(req_to_slot.shape)} "
                         f"with strides {req_to_slot.stride()}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logit_cap is not None and logit_cap <= 0:
        raise ValueError(f"logit_cap must be > 0, got {logit_cap}")


def check_per_request(*tensors: torch.Tensor) -> int:
    batch = tensors[0].shape[0]
    for t in tensors:
        check_int_vector(t, "per-request metadata", batch)
    return batch


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_slot: torch.Tensor,
                     req_rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     extend_start: torch.Tensor, scale: float, sliding_window: int | None = None,
                     logit_cap: float | None = None, max_extend_len: int | None = None,
                     block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_buf, v_buf [S, Hkv, D]; req_to_slot [R, C]; the rest [B]. Returns [T, Hq, D].

    `max_extend_len` (a host int) sizes the grid; without it, it is read from extend_lens (a sync).
    """
    check_launchable(_extend_attention_kernel, q, k_buf, v_buf, req_to_slot, req_rows, prefix_lens,
                     extend_lens, extend_start)
    check_attention_args(q, k_buf, v_buf, req_to_slot, sliding_window, logit_cap)
    batch = check_per_request(req_rows, prefix_lens, extend_lens, extend_start)
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if batch == 0 or q.shape[0] == 0:
        return out
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    block_d = next_pow2(head_dim)
    block_m = block_m or (32 if block_d > 128 else 64)
    block_n = block_n or (32 if block_d > 128 else 64)
    grid = (batch, num_heads, cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, k_buf, v_buf, out, req_to_slot,
        req_rows, prefix_lens, extend_lens, extend_start,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_slot.stride(0),
        scale, logit_cap or 0.0, sliding_window or 0, num_heads // k_buf.shape[1], head_dim,
        HAS_CAP=logit_cap is not None, HAS_WINDOW=sliding_window is not None,
        INTERPRETED=is_interpreted(_extend_attention_kernel),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8, num_stages=1 if block_d > 128 else 2,
    )
    return out


def extend_attention_reference(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                               req_to_slot: torch.Tensor, req_rows: torch.Tensor,
                               prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                               extend_start: torch.Tensor, scale: float,
                               sliding_window: int | None = None,
                               logit_cap: float | None = None) -> torch.Tensor:
    """The same attention, one request at a time, in fp32 torch."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_buf.shape[1]
    for row, prefix, n, first in zip(req_rows.tolist(), prefix_lens.tolist(), extend_lens.tolist(),
                                     extend_start.tolist()):
        slots = req_to_slot[row, :prefix + n].long()
        k = k_buf[slots].float().repeat_interleave(group, dim=1)      # [L, Hq, D]
        v = v_buf[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[first:first + n].float(), k) * scale
        if logit_cap is not None:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        q_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        k_pos = torch.arange(prefix + n, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[first:first + n] = torch.einsum("htl,lhd->thd", probs, v).to(q.dtype)
    return out
