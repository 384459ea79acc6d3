"""W4A16 matmul: `x @ W^T` with W stored as 4-bit integers and per-group scales and zero points.

Weight format (what a loader produces; `quantize_w4` makes it from a float [N, K] weight):

    qweight  uint8 [N, K // 2]   two 4-bit values q in 0..15 a byte, packed along K, low nibble
                                 first: qweight[n, j] = q[n, 2j] | q[n, 2j + 1] << 4
    scales   [K // group, N]     in the activation dtype (fp32, fp16 or bf16)
    zeros    [K // group, N]     the same dtype

    w[n, k] = (q[n, k] - 8) * scales[k // group, n] + zeros[k // group, n]

group is 32, 64 or 128 and K must be a multiple of it. The zero point is a float, added after the
scaling (asymmetric: `quantize_w4` maps each group's [min, max] onto q = 0 .. 15, so
zero = min + 8 * scale). This is the convention of torch's CPU int4 kernel,
`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_and_zeros)`, whose
scale_and_zeros is `torch.stack([scales, zeros], -1)`, [K // group, N, 2], and whose packed weight
is `torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)` of the unpacked q [N, K]
(int32 values 0..15). Checked numerically on CPU with torch 2.13 (tests/test_w4a16.py repeats it):
for x [7, 256] and a random weight [80, 256] quantized by `quantize_w4` with group 32 or 128,
torch's kernel and `w4a16_matmul_reference` agree to 2.7e-5 in fp32 (outputs up to ~57), and in
bf16 to 0.25, one bf16 ulp at that size: torch dequantizes to fp32 and does not round the weight to
bf16 as we do (it is within 0.12, half an ulp, of the product with the fp32 dequantized weight).
The other readings of scale_and_zeros, `q * scale + zero` and `(q - 8) * scale - zero`, are off by
37 to 134. torch's packed bytes are another layout (for N = 64, K-major [K, 32] bytes with rows n and
n + 32 sharing a byte), so the two formats share the quantizer and scale_and_zeros, not the bytes.

The dequantized weight is computed in fp32 and rounded once to the activation dtype, and the
product accumulates in fp32: `w4a16_matmul_reference` is `x.float() @ dequantize_w4(...).float().T`,
cast to x's dtype, and the kernel computes the same (in another summation order).

The kernel: each program owns a BLOCK_M x BLOCK_N output tile and walks K in steps of BLOCK_K,
which divides the group size, so a step lies in one group and needs one row of scales and zeros.
It loads the step's packed bytes [BLOCK_N, BLOCK_K // 2], splits each byte into its two nibbles,
interleaves them back into K order, dequantizes, rounds to the activation dtype and feeds tl.dot.
Rows of x past M and columns past N are masked; K needs no mask. When the output has too few
tiles to fill the GPU (decode, small N), K is split across programs (split-K): each writes an fp32
partial tile and the launcher sums them.
"""
from __future__ import annotations

import torch

from stemma.kernels._triton import (cast, cdiv, check_last_dim_contiguous, check_launchable, dot,
                                    is_interpreted, jit, tl)

GROUP_SIZES = (32, 64, 128)
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def _w4a16_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr,
                  M, N, K, group_size, split_len,
                  stride_xm, stride_qn, stride_sg, stride_zg, stride_os, stride_om,
                  INTERPRETED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = qweight_ptr + offs_n.to(tl.int64)[:, None] * stride_qn

    split = tl.program_id(2)
    k_start = split * split_len
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + split_len, K), BLOCK_K):
        a = tl.load(x_rows + k0 + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        packed = tl.load(q_rows + k0 // 2 + offs_byte[None, :], mask=n_mask[:, None], other=0)
        q = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K], K order
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = cast((q - 8.0) * scale[:, None] + zero[:, None], x_ptr.dtype.element_ty, INTERPRETED)
        acc += dot(a, tl.trans(w), INTERPRETED)

    out = cast(acc, out_ptr.dtype.element_ty, INTERPRETED)
    out_rows = out_ptr + split * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


def _check_group_size(group_size: int, k: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"K ({k}) must be a multiple of group_size ({group_size})")


def _check_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> tuple[int, int]:
    """Raises unless (qweight, scales, zeros) hold a W4 weight in the module's format; returns (N, K)."""
    if qweight.dtype != torch.uint8:
        raise TypeError(f"qweight must be uint8 (two 4-bit values a byte), got {qweight.dtype}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be [N, K // 2], got {tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    _check_group_size(group_size, k)
    if scales.dtype not in ACTIVATION_DTYPES or zeros.dtype != scales.dtype:
        raise TypeError(f"scales and zeros must share one of {ACTIVATION_DTYPES}, got {scales.dtype} "
                        f"and {zeros.dtype}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (k // group_size, n):
            raise ValueError(f"{name} must be [K // group_size, N] = [{k // group_size}, {n}], "
                             f"got {tuple(t.shape)}")
    return n, k


def _check_activation(x: torch.Tensor, scales: torch.Tensor, k: int) -> None:
    if x.dtype != scales.dtype:
        raise TypeError(f"x is {x.dtype} but the scales and zeros are {scales.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., K] with K = {k}, got {tuple(x.shape)}")


def quantize_w4(weight: torch.Tensor, group_size: int,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes a float weight [N, K] to (qweight, scales, zeros) in this module's format.

    Each group of `group_size` values along K maps its [min, max] onto q = 0 .. 15. Scales and
    zeros are stored in `dtype` (the activation dtype; default the weight's) and q is rounded
    against the stored values, so each value is off by at most half its group's scale, plus the
    rounding of scale and zero to `dtype`.
    """
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a float tensor, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
    dtype = weight.dtype if dtype is None else dtype
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"scales are stored in one of {ACTIVATION_DTYPES}, got {dtype}")
    n, k = weight.shape
    _check_group_size(group_size, k)
    groups = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(dtype).tiny).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None]) + 8
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, k // 2, 2)
    qweight = q[..., 0] | (q[..., 1] << 4)
    return qweight, scale.t().contiguous(), zero.t().contiguous()


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of a packed [N, K // 2] uint8 weight, as uint8 [N, K] in 0 .. 15."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """The weight [N, K]: computed in fp32, returned in the scales' dtype."""
    _check_weight(qweight, scales, zeros, group_size)
    q = unpack_w4(qweight).float()
    per_column = lambda t: t.float().repeat_interleave(group_size, dim=0).t()  # noqa: E731  [N, K]
    return ((q - 8) * per_column(scales) + per_column(zeros)).to(scales.dtype)


def w4a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] @ dequantize_w4(...)^T, accumulated in fp32; [..., N] in x's dtype."""
    _, k = _check_weight(qweight, scales, zeros, group_size)
    _check_activation(x, scales, k)
    w = dequantize_w4(qweight, scales, zeros, group_size)
    return (x.float() @ w.float().t()).to(x.dtype)


def default_blocks(m: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the smallest tl.dot tile over M for decode, larger for prefill."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, min(group_size, 64)


def default_split_k(tiles: int, steps: int, device: torch.device) -> int:
    """Enough K splits for about two programs an SM when the output has few tiles (decode with a
    small N), keeping two K steps a split; one split off CUDA."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, steps // 2, 2 * sms // tiles))


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, block_m: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for the W4 weight (qweight [N, K // 2], scales and zeros [K // group_size, N]).

    Returns [..., N] in x's dtype, which the scales and zeros must share. Block sizes default from
    `default_blocks`; each must be a power of two >= 16, and block_k must divide group_size. With
    split_k > 1 (default `default_split_k`), K is cut into that many runs of whole BLOCK_K steps,
    each program writes its fp32 partial tile, and the partials are summed (in fp32) and cast.
    """
    n, k = _check_weight(qweight, scales, zeros, group_size)
    _check_activation(x, scales, k)
    check_last_dim_contiguous("x, qweight, scales and zeros", x, qweight, scales, zeros)
    check_launchable(_w4a16_kernel, x, qweight, scales, zeros)
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    defaults = default_blocks(m, group_size)
    block_m, block_n, block_k = (given or default
                                 for given, default in zip((block_m, block_n, block_k), defaults))
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    if group_size % block_k:
        raise ValueError(f"block_k ({block_k}) must divide group_size ({group_size})")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    grid_m, grid_n, steps = cdiv(m, block_m), cdiv(n, block_n), k // block_k
    split_k = split_k or default_split_k(grid_m * grid_n, steps, x.device)
    steps_per_split = cdiv(steps, split_k) if steps else 1
    split_k = max(cdiv(steps, steps_per_split), 1)  # no split without a step
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        _w4a16_kernel[(grid_m, grid_n, split_k)](
            rows, qweight, scales, zeros, part,
            m, n, k, group_size, steps_per_split * block_k,
            rows.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0),
            0 if split_k == 1 else part.stride(0), part.stride(-2),
            INTERPRETED=is_interpreted(_w4a16_kernel),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4, num_stages=3,
        )
        if split_k > 1:
            out.copy_(part.sum(dim=0))
    return out.view(*x.shape[:-1], n)
