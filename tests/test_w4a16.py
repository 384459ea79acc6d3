"""The W4A16 matmul: quantizer round trip, the Triton kernel against its torch reference under the
interpreter on odd shapes, bad inputs, and the reference against torch's CPU int4 kernel."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # Triton reads it when a kernel is decorated: before any import

import pytest

pytest.importorskip("triton")

import torch
import torch.nn.functional as F

from stemma.kernels._triton import is_interpreted
from stemma.kernels.w4a16_matmul import (_w4a16_kernel, dequantize_w4, quantize_w4, unpack_w4, w4a16_matmul,
                                         w4a16_matmul_reference)

if not is_interpreted(_w4a16_kernel):
    raise RuntimeError("stemma.kernels was imported before TRITON_INTERPRET=1 was set")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random weight with the awkward groups in it: a constant row and a row with an outlier."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=gen)
    w[1] = 0.37
    w[2, 5] = 40.0
    return w


def inputs(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int = 0):
    qweight, scales, zeros = quantize_w4(make_weight(n, k, seed), group, dtype)
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, qweight, scales, zeros


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel and the reference multiply the same rounded weight; only the fp32 summation order
    differs, so fp32 agrees to a few ulps and bf16 to one ulp of the output."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-3)


# --- the format and the quantizer ---

def test_nibbles_are_low_first_and_offset_by_8():
    qweight = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)  # q = 1, 2, 0, 15 along K
    assert unpack_w4(qweight).tolist() == [[1, 2, 0, 15]]
    qweight = qweight.repeat(1, 16)  # K = 64
    scales = torch.tensor([[0.5], [2.0]])  # [K // 32, N = 1]
    zeros = torch.tensor([[1.0], [-3.0]])
    w = dequantize_w4(qweight, scales, zeros, 32)
    assert w.shape == (1, 64)
    assert w[0, :4].tolist() == [(1 - 8) * 0.5 + 1, (2 - 8) * 0.5 + 1, (0 - 8) * 0.5 + 1, (15 - 8) * 0.5 + 1]
    assert w[0, 32:36].tolist() == [(1 - 8) * 2 - 3, (2 - 8) * 2 - 3, (0 - 8) * 2 - 3, (15 - 8) * 2 - 3]


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_round_trip_error_is_half_a_scale(group, dtype):
    n, k = 48, 256
    w = make_weight(n, k).to(dtype)
    qweight, scales, zeros = quantize_w4(w, group)
    assert qweight.shape == (n, k // 2) and qweight.dtype == torch.uint8
    assert scales.shape == zeros.shape == (k // group, n) and scales.dtype == zeros.dtype == dtype
    q = unpack_w4(qweight).view(n, k // group, group)
    varying = torch.ones(n, dtype=torch.bool)
    varying[1] = False
    assert (q[varying].amin(-1) == 0).all() and (q[varying].amax(-1) == 15).all()  # the full range

    back = dequantize_w4(qweight, scales, zeros, group)
    assert back.dtype == dtype
    per_column = lambda t: t.float().repeat_interleave(group, 0).t()  # noqa: E731
    s, z = per_column(scales), per_column(zeros)
    err = (back.float() - w.float()).abs()
    # half a scale, plus the rounding of scale, zero and the result to `dtype`
    slack = torch.finfo(dtype).eps * (w.float().abs() + z.abs() + 8 * s)
    assert (err <= s / 2 + slack).all(), f"worst excess {(err - s / 2 - slack).max():.3g}"
    assert (back[1] == w[1]).all()  # a constant group comes back exactly


# --- the kernel against the reference ---

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("k, group", [(64, 32), (256, 32), (256, 128)])  # K is a multiple of the group
@pytest.mark.parametrize("n", [48, 80])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_kernel_matches_reference(m, n, k, group, dtype):
    x, qweight, scales, zeros = inputs(m, n, k, group, dtype, seed=m + n + k)
    ref = w4a16_matmul_reference(x, qweight, scales, zeros, group)
    assert_matches_reference(w4a16_matmul(x, qweight, scales, zeros, group), ref)


@pytest.mark.parametrize("blocks", [(16, 16, 16), (32, 32, 32), (64, 128, 64)])
def test_kernel_block_sizes(blocks):
    """Several K steps a group (block_k 16 with group 64), many tiles, one tile wider than N."""
    block_m, block_n, block_k = blocks
    x, qweight, scales, zeros = inputs(33, 80, 256, 64, BF16, seed=3)
    out = w4a16_matmul(x, qweight, scales, zeros, 64, block_m=block_m, block_n=block_n, block_k=block_k)
    assert_matches_reference(out, w4a16_matmul_reference(x, qweight, scales, zeros, 64))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("split_k", [2, 3, 16])
def test_kernel_split_k(split_k, dtype):
    """K cut into runs of whole steps: 8 steps of 32 in 2 runs of 4, 3 of 3, 3, 2, or 8 of 1."""
    x, qweight, scales, zeros = inputs(7, 80, 256, 64, dtype, seed=4)
    out = w4a16_matmul(x, qweight, scales, zeros, 64, block_k=32, split_k=split_k)
    assert_matches_reference(out, w4a16_matmul_reference(x, qweight, scales, zeros, 64))


def test_kernel_fp16_batched_and_empty():
    x, qweight, scales, zeros = inputs(6, 48, 128, 32, F16, seed=5)
    x = x.view(2, 3, 128)
    out = w4a16_matmul(x, qweight, scales, zeros, 32)
    assert out.shape == (2, 3, 48)
    assert_matches_reference(out, w4a16_matmul_reference(x, qweight, scales, zeros, 32))
    assert w4a16_matmul(x[:0], qweight, scales, zeros, 32).shape == (0, 3, 48)


def test_kernel_is_close_to_the_float_weight():
    """Quantization error only: the product with the unquantized weight is near."""
    w = torch.randn((80, 256), generator=torch.Generator().manual_seed(7))
    x = torch.randn((7, 256), generator=torch.Generator().manual_seed(8))
    out = w4a16_matmul(x, *quantize_w4(w, 32), 32)
    assert F.cosine_similarity(out.flatten(), (x @ w.t()).flatten(), dim=0) > 0.99


# --- bad inputs ---

def test_bad_inputs_raise():
    x, qweight, scales, zeros = inputs(7, 48, 128, 32, F32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_w4(torch.randn(8, 96), 64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_w4(torch.randn(8, 96), 48)
    with pytest.raises(TypeError, match="float"):
        quantize_w4(torch.ones(8, 64, dtype=torch.int32), 32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        w4a16_matmul(x[:, :64], qweight[:, :32], scales[:1], zeros[:1], 128)
    with pytest.raises(TypeError, match="uint8"):
        w4a16_matmul(x, qweight.to(torch.int32), scales, zeros, 32)
    with pytest.raises(TypeError, match="x is torch.bfloat16"):
        w4a16_matmul(x.to(BF16), qweight, scales, zeros, 32)
    with pytest.raises(TypeError, match="scales and zeros"):
        w4a16_matmul(x, qweight, scales, zeros.to(BF16), 32)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_matmul(x, qweight, scales.t().contiguous(), zeros, 32)
    with pytest.raises(ValueError, match="x must be"):
        w4a16_matmul(x[:, :64], qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="contiguous"):
        w4a16_matmul(x.t().contiguous().t(), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="block_k"):
        w4a16_matmul(x, qweight, scales, zeros, 32, block_k=64)
    with pytest.raises(ValueError, match="split_k"):
        w4a16_matmul(x, qweight, scales, zeros, 32, split_k=0)
    with pytest.raises(ValueError, match="power of two"):
        w4a16_matmul(x, qweight, scales, zeros, 32, block_n=24)
    with pytest.raises(TypeError, match="x is"):
        w4a16_matmul_reference(x.to(BF16), qweight, scales, zeros, 32)


# --- torch's CPU int4 kernel uses the same convention ---

def torch_int4_mm(x, qweight, scales, zeros, group):
    try:
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    except (AttributeError, RuntimeError):
        pytest.skip("this torch has no CPU int4 kernel")
    packed = convert(unpack_w4(qweight).to(torch.int32), 1)
    return mm(x, packed, group, torch.stack([scales, zeros], -1).contiguous())


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("group", [32, 128])
def test_reference_matches_torch_cpu_int4(group, dtype):
    x, qweight, scales, zeros = inputs(7, 80, 256, group, dtype, seed=11)
    out = torch_int4_mm(x, qweight, scales, zeros, group).float()
    ref = w4a16_matmul_reference(x, qweight, scales, zeros, group).float()
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:  # torch multiplies the fp32 dequantized weight; ours is rounded to bf16 first
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=0.1)
        assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.9999
    # the other readings of scale_and_zeros are far off
    q = unpack_w4(qweight).float()
    s = scales.float().repeat_interleave(group, 0).t()
    z = zeros.float().repeat_interleave(group, 0).t()
    for other in (q * s + z, (q - 8) * s - z):
        assert (out - x.float() @ other.t()).abs().max() > 1.0
