"""How a linear layer's weight matrix W [out, in] is held: dense, or weight-only quantized.

    dense  W in the model dtype; kernels `linear` (F.linear), `mm_t` (W @ x^T, a transposed view)
           or `packed` (oneDNN's linear over a copy of W reordered once into its blocked layout:
           on this project's 2-core EPYC, 1.6-2x faster than F.linear at 1-8 rows)
    int8   per-output-channel symmetric: W ~ q * s[n], q int8 [out, in], s [out] in the activation
           dtype; kernel torch.ops.aten._weight_int8pack_mm
    int4   per-group asymmetric: W[n, k] ~ (q - 8) * scale[k // g, n] + zero[k // g, n], q in
           [0, 15], packed by torch.ops.aten._convert_weight_to_int4pack_for_cpu; kernel
           _weight_int4pack_mm_for_cpu (scale and zero interleaved as [in // g, out, 2])

Each store computes `x @ W^T` with a named kernel and reads whole rows back (`rows`), which is
how a tied embedding looks its tokens up in the same storage as the output matrix: one copy.
The int8 and int4 kernels give a row bit for bit the same result whatever else is in the batch
(checked in tests), so a quantized request's output does not depend on what it was batched with;
dense F.linear does not promise that (oneDNN picks its path by row count), only closeness.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from stemma.engine_config import INT4_GROUP_SIZES

_INT4_BLOCK_N = 64  # rows per block of torch's CPU int4 packing (see _unpack_int4_rows)


def packing_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold `weight` prepacked (a CPU build with mkldnn, bf16 or fp32)."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # oneDNN reorders bf16 only on CPUs with bf16-capable instructions (as Inductor checks)
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


# `stemma::packed_linear(x, packed, out_features)`: x [rows, in] @ W^T through oneDNN's prepacked
# copy of W, the form a compiled graph calls (Inductor cannot lower the mkldnn op over a packed
# tensor it did not pack itself). Defined through torch.library.Library rather than the
# `custom_op` decorator: a compiled decode step calls it once per dense matrix (72 on the default
# model), and through the decorator's Python wrapper a call took 38 us against 30 (640 x 640, one row).
_LIB = torch.library.Library("stemma", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor packed, int out_features) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("stemma::packed_linear", _packed_linear_fake, lib=_LIB)


class DenseWeight:
    """W in the model dtype. The `packed` copy is made on first use; `settle` drops the copy a
    matrix's kernel choice does not use. Invariant: at least one of `weight` and `packed` is held."""
    kind = "dense"

    def __init__(self, weight: torch.Tensor):
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self._shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.kernels = ("linear", "mm_t", "packed") if packing_available(weight) else ("linear", "mm_t")

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    def matmul(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == "packed" or self.weight is None:
            return self._packed_matmul(x)
        if kernel == "mm_t" and x.dim() == 2 and x.shape[0] > 0:
            rows = x.shape[0]
            xt = torch.cat([x, x]).t() if rows == 1 else x.t()  # oneDNN's gemv path is slower
            return torch.mm(self.weight, xt)[:, :rows].t()
        return F.linear(x, self.weight)

    def _pack(self) -> torch.Tensor:
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        return self.packed

    def _packed_matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if torch.compiler.is_dynamo_compiling():  # packed before any compile: the graph only reads it
            y = torch.ops.stemma.packed_linear(rows, self.packed, self._shape[0])
        else:  # the op's body, without the registered op's dispatch to Python
            y = _packed_linear(rows, self._pack(), self._shape[0])
        return y.reshape(*x.shape[:-1], self._shape[0])

    def settle(self, kernels: set[str], keep_dense: bool) -> None:
        """Keeps only the copies that `kernels` (every kernel the matrix may run) read; the dense
        weight also stays when `keep_dense` (an embedding's rows are read from it)."""
        if "packed" not in kernels:
            self.packed = None
            return
        self._pack()
        if not keep_dense and kernels == {"packed"}:
            self.weight = None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def dequantize(self) -> torch.Tensor:
        if self.weight is None:  # x = I reads the packed matrix back exactly: one term per output
            return self._packed_matmul(torch.eye(self._shape[1], dtype=self.dtype)).t().float()
        return self.weight.float()

    def nbytes(self) -> int:
        held = [t for t in (self.weight, self.packed) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)


def _scale_floor(dtype: torch.dtype) -> float:
    """The smallest scale a store keeps: `dtype`'s smallest subnormal (1e-12 was 0 in float16)."""
    return torch.finfo(dtype).tiny * torch.finfo(dtype).eps


_INT8_K_STEP = 16  # torch's int8 kernel (bf16, torch 2.13) reads past a row whose length is not a
                  # multiple of this: garbage or a crash (k = 40: NaN; 120: inf; 200: SIGSEGV)


class Int8Weight:
    """Per-row int8 weights and scales. `q`'s rows are zero-padded to a multiple of
    _INT8_K_STEP columns, and the activations with them, which leaves every product as it is."""
    kind = "int8"
    kernels = ("int8",)

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, in_features: int | None = None):
        self.q, self.scales = q, scales
        self.in_features = q.shape[1] if in_features is None else in_features

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype,
                 absmax: torch.Tensor | None = None) -> Int8Weight:
        """`absmax`: each row's largest magnitude, when `weight` holds a slice of wider rows."""
        w = weight.float()
        # the scale as the kernel will see it (rounded to `dtype`), so each weight is off by at
        # most half a step
        absmax = w.abs().amax(dim=1) if absmax is None else absmax
        scales = (absmax / 127.0).clamp(min=_scale_floor(dtype)).to(dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        k = q.shape[1]
        return cls(F.pad(q, (0, -k % _INT8_K_STEP)).contiguous(), scales, k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.in_features

    def matmul(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = _rows_of(x, self.scales.dtype)
        if self.q.shape[1] != self.in_features:
            rows = F.pad(rows, (0, self.q.shape[1] - self.in_features))
        y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scales)
        return y.reshape(*lead, -1).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids, :self.in_features].to(self.scales.dtype) * self.scales[ids, None]

    def dequantize(self) -> torch.Tensor:
        return self.q[:, :self.in_features].float() * self.scales.float()[:, None]

    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


class Int4Weight:
    kind = "int4"
    kernels = ("int4",)

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, in_features: int):
        self.packed, self.scale_zeros = packed, scale_zeros
        self.group_size, self.in_features = group_size, in_features

    @staticmethod
    def supports(weight: torch.Tensor, group_size: int) -> bool:
        """Whether torch's CPU int4 path takes this shape: out a multiple of its 64-row packing
        blocks, in a multiple of the group size."""
        out, k = weight.shape
        return out % _INT4_BLOCK_N == 0 and k % group_size == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype, group_size: int) -> Int4Weight:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if not cls.supports(weight, group_size):
            raise ValueError(f"int4 needs out % {_INT4_BLOCK_N} == 0 and in % {group_size} == 0, "
                             f"got {tuple(weight.shape)}")
        out, k = weight.shape
        w = weight.float().reshape(out, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        # scale and zero as the kernel will see them (rounded to `dtype`); (q - 8) * scale + zero
        # spans [lo, hi] in 15 steps
        scale = ((hi - lo) / 15.0).clamp(min=_scale_floor(dtype)).to(dtype).float()
        zero = (lo + 8.0 * scale).to(dtype).float()
        q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out, k).contiguous(), 1)
        scale_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, scale_zeros, group_size, k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.in_features)

    def matmul(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _rows_of(x, self.scale_zeros.dtype), self.packed, self.group_size, self.scale_zeros)
        return y.reshape(*lead, -1).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, unpacked from the known packing layout (a tied embedding is held in
        int4 only where torch packs in it: `check_int4_layout`); elsewhere read through the
        kernel (`dequantize`), which no hot path does."""
        if not check_int4_layout():
            return self.dequantize().to(self.scale_zeros.dtype)[ids]
        q = _unpack_int4_rows(self.packed, ids.reshape(-1), self.in_features)
        g = self.group_size
        sz = self.scale_zeros[:, ids.reshape(-1)]                      # [in // g, T, 2]
        scale = sz[..., 0].t().repeat_interleave(g, dim=1)             # [T, in]
        zero = sz[..., 1].t().repeat_interleave(g, dim=1)
        out = (q.to(scale.dtype) - 8) * scale + zero
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """W as the kernel computes with it, read back through the kernel (x = I: one term per
        output), so it holds whatever torch's packing layout on this CPU."""
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        return self.matmul(eye, "int4").t().float()

    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zeros.numel() * self.scale_zeros.element_size()


def _rows_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the [rows, in] row-major matrix the quantized kernels take (a dense `mm_t` result is a
    transposed view)."""
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous()


def _unpack_int4_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the int4 values that _convert_weight_to_int4pack_for_cpu(q, 1) packed.

    Its layout, as measured on torch 2.13 (and re-checked by `check_int4_layout` before use):
    rows come in blocks of 64; a block is [k / 2, 64] bytes, where byte (j, c) holds
    q[32 * h + c % 32, 2 * j + c // 32] of the block, h = 0 in the low nibble and 1 in the high.
    """
    out = packed.shape[0]
    blocks = packed.reshape(out // _INT4_BLOCK_N, k // 2, _INT4_BLOCK_N)
    block, i = ids // _INT4_BLOCK_N, ids % _INT4_BLOCK_N
    chosen = blocks[block].to(torch.int32)                              # [T, k/2, 64]
    col = (i % 32)[:, None, None].expand(-1, k // 2, 1)
    even = chosen[:, :, :32].gather(2, col)[..., 0]
    odd = chosen[:, :, 32:].gather(2, col)[..., 0]
    shift = torch.where(i < 32, 0, 4).to(torch.int32)[:, None]
    return torch.stack([(even >> shift) & 15, (odd >> shift) & 15], dim=-1).reshape(len(ids), k)


@functools.cache
def check_int4_layout() -> bool:
    """Whether this torch packs int4 as _unpack_int4_rows reads it (a tied embedding in int4
    depends on it; without it, that matrix is held in int8)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (2 * _INT4_BLOCK_N, 64), dtype=torch.int32, generator=gen)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError):
        return False
    if tuple(packed.shape) != (q.shape[0], q.shape[1] // 2):
        return False
    return torch.equal(_unpack_int4_rows(packed, torch.arange(q.shape[0]), q.shape[1]), q)


WeightStore = DenseWeight | Int8Weight | Int4Weight
