"""Rotary position embedding, applied in place, in the rotate-half (NEOX) layout HF Llama uses.

Dimension d < D/2 is paired with d + D/2:
    x[d]       <- x[d] * cos[pos, d] - x[d + D/2] * sin[pos, d]
    x[d + D/2] <- x[d + D/2] * cos[pos, d] + x[d] * sin[pos, d]
computed in fp32 and rounded to x's dtype once.
"""
from __future__ import annotations

import torch

from stemma.kernels._triton import (cast, check_int_vector, check_last_dim_contiguous, check_launchable,
                                    is_interpreted, jit, next_pow2, tl)


@jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half,
                  INTERPRETED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < half)
    lo_ptr = x_ptr + h * stride_h + d
    x1 = tl.load(lo_ptr, mask=mask).to(tl.float32)
    x2 = tl.load(lo_ptr + half, mask=mask).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(lo_ptr, cast(x1 * cos - x2 * sin, dtype, INTERPRETED), mask=mask)
    tl.store(lo_ptr + half, cast(x2 * cos + x1 * sin, dtype, INTERPRETED), mask=mask)


@jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   num_q_heads, num_k_heads, half,
                   INTERPRETED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d < half).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=d < half).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, half,
                  INTERPRETED, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, half,
                  INTERPRETED, BLOCK_HK, BLOCK_HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place; positions [T]; cos, sin [max_pos, D/2]."""
    check_launchable(_rotary_kernel, q, k, positions, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    half = head_dim // 2
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != half:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [max_pos, {half}]")
    check_int_vector(positions, "positions", num_tokens)
    check_last_dim_contiguous("the last dim", q, k, cos, sin)
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        num_q_heads, k.shape[1], half,
        INTERPRETED=is_interpreted(_rotary_kernel),
        BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
    )


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor) -> None:
    c = cos[positions].float()[:, None, :]
    s = sin[positions].float()[:, None, :]
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
