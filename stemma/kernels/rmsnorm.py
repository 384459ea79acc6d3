"""RMSNorm, optionally fused with the residual add before it.

    x = x + residual                  (when a residual is given; rounded to x's dtype, as an
                                       unfused add would be, and returned as the new residual)
    y = x / sqrt(mean(x^2) + eps) * w (gemma: * (1 + w))

Everything after the add is computed in fp32; y is cast to x's dtype once, at the end.
"""
from __future__ import annotations

import torch

from stemma.kernels._triton import (cast, check_last_dim_contiguous, check_launchable, is_interpreted, jit,
                                    next_pow2, tl)


@jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
                    stride_x, stride_res, stride_out, stride_sum,
                    hidden, eps,
                    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, INTERPRETED: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = cast(x.to(tl.float32) + res.to(tl.float32), x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    out = cast(x * inv_rms * w, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    if x.shape[-1] != hidden:
        raise ValueError(f"last dim must be {hidden}, got {tuple(x.shape)}")
    check_last_dim_contiguous("the last dim", x)
    return x.reshape(-1, hidden)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalizes x [..., H] over its last dim. With a residual, returns (normed, x + residual)."""
    hidden = weight.shape[-1]
    if weight.dim() != 1:
        raise ValueError(f"weight must be [H], got {tuple(weight.shape)}")
    rows = _rows(x, hidden)
    out = torch.empty_like(rows)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual is {residual.dtype} but x is {x.dtype}")
    res = _rows(residual, hidden) if residual is not None else rows
    x_sum = torch.empty_like(rows) if residual is not None else out
    check_launchable(_rmsnorm_kernel, rows, res, weight)
    if rows.shape[0]:
        _rmsnorm_kernel[(rows.shape[0],)](
            rows, res, weight, out, x_sum,
            rows.stride(0), res.stride(0), out.stride(0), x_sum.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, GEMMA=gemma, INTERPRETED=is_interpreted(_rmsnorm_kernel),
            BLOCK=next_pow2(hidden),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), x_sum.view(x.shape)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None,
                      gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    w = weight.float() + 1.0 if gemma else weight.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    return out if residual is None else (out, x)
