"""Writes the new tokens' K and V into their slots of the KV pool."""
from __future__ import annotations

import torch

from stemma.kernels._triton import (cast, check_int_vector, check_last_dim_contiguous, check_launchable,
                                    is_interpreted, jit, next_pow2, tl)


@jit
def _kv_write_kernel(k_ptr, v_ptr, slot_ptr, k_buf_ptr, v_buf_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     num_heads, head_dim,
                     INTERPRETED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    k = cast(k, k_buf_ptr.dtype.element_ty, INTERPRETED)
    v = cast(v, v_buf_ptr.dtype.element_ty, INTERPRETED)
    tl.store(k_buf_ptr + slot * stride_kbs + h * stride_kbh + d, k, mask=mask)
    tl.store(v_buf_ptr + slot * stride_vbs + h * stride_vbh + d, v, mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
    """`k_buf[slots[t]] = k[t]` and `v_buf[slots[t]] = v[t]`, cast to the buffers' dtype.

    k, v: [T, Hkv, D]; slots: [T] int; k_buf, v_buf: [S, Hkv, D]. Slots must be distinct.
    """
    check_launchable(_kv_write_kernel, k, v, slots, k_buf, v_buf)
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    check_int_vector(slots, "slots", num_tokens)
    for buf in (k_buf, v_buf):
        if buf.dim() != 3 or buf.shape[1:] != (num_heads, head_dim):
            raise ValueError(f"buffer {tuple(buf.shape)} does not hold [*, {num_heads}, {head_dim}]")
    check_last_dim_contiguous("the head dim", k, v, k_buf, v_buf)
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, slots, k_buf, v_buf,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        num_heads, head_dim,
        INTERPRETED=is_interpreted(_kv_write_kernel),
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
    )


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                       k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
    k_buf[slots] = k.to(k_buf.dtype)
    v_buf[slots] = v.to(v_buf.dtype)
