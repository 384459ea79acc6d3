"""GGML block dequantizers in torch: raw GGUF tensor bytes -> float32.

Each quantized type stores a tensor row as consecutive fixed-size blocks. A block holds one or
two float16 scales and packed integer codes. Every function below takes the blocks as a
`[n_blocks, type_size]` uint8 tensor and returns `[n_blocks, block_size]` float32.

The arithmetic follows ggml's reference order (scale products first, then `* q`, then `- min`),
so the results are bit-identical to `gguf.quants.dequantize`, which is what Hugging Face's GGUF
loader uses.

Block layouts (bytes, in file order; "f16" is little-endian IEEE half):

    Q4_0  f16 d | 16 B nibbles                      x = d * (q - 8)
    Q4_1  f16 d | f16 m | 16 B nibbles              x = d * q + m
    Q5_0  f16 d | u32 high bits | 16 B nibbles      x = d * (q - 16)
    Q5_1  f16 d | f16 m | u32 high bits | 16 B      x = d * q + m
    Q8_0  f16 d | 32 x int8                         x = d * q
    Q2_K  16 B scales/mins (4+4 bit) | 64 B 2-bit codes | f16 d | f16 dmin
    Q3_K  32 B high-bit mask | 64 B 2-bit codes | 12 B 6-bit scales | f16 d
    Q4_K  f16 d | f16 dmin | 12 B 6-bit scales/mins | 128 B nibbles
    Q5_K  f16 d | f16 dmin | 12 B 6-bit scales/mins | 32 B high bits | 128 B nibbles
    Q6_K  128 B low nibbles | 64 B 2-bit highs | 16 x int8 scales | f16 d

In the 32-element types, byte j of the nibble run holds element j (low nibble) and element
j + 16 (high nibble); Q5 keeps bit 4 of element j at bit j of the u32. The K types use 256-element
super-blocks split into sub-blocks of 32 (Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K).
"""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import gguf
import numpy as np
import torch

QT = gguf.GGMLQuantizationType
QK_K = 256
_CHUNK_ELEMENTS = 32767  # see dequantize: below torch's intra-op grain size


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as a float32 column [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] codes: all low nibbles first, then all high nibbles."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _bit_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., k] bytes -> [..., 8 // bits, k]: plane p holds (byte >> (p * bits)) & mask."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-2) >> shifts.unsqueeze(-1)) & ((1 << bits) - 1)


def _low_bits_first(packed: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] bits, bit i of byte j landing at 8j + i (little-endian order)."""
    return _bit_planes(packed, 1).transpose(-1, -2).reshape(packed.shape[0], -1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float() * _half(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).float()
    return _half(blocks, 0) * q + _half(blocks, 2)


def _five_bit(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return _nibbles(low) | (_low_bits_first(high) << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks[:, 2:6], blocks[:, 6:]).to(torch.int8) - 16
    return _half(blocks, 0) * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks[:, 4:8], blocks[:, 8:]).float()
    return _half(blocks, 0) * q + _half(blocks, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, as float32 [n, 8].

    Bytes 0-3 and 4-7 hold scales 0-3 and mins 0-3 in their low 6 bits; their top 2 bits are
    the high bits of scales 4-7 and mins 4-7, whose low 4 bits sit in bytes 8-11 (scale in the
    low nibble, min in the high one).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)), dim=-1)
    mins = torch.cat((b & 0x3F, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _q4_k_codes(packed: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [n, 8, 32]: each 32-byte run gives two sub-blocks (low, then high nibbles)."""
    return _nibbles(packed.reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (_half(blocks, 0) * scales).unsqueeze(-1)
    dm = (_half(blocks, 2) * mins).unsqueeze(-1)
    return (d * q.float() - dm).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _q4_k_codes(blocks[:, 16:144]))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = _bit_planes(blocks[:, 16:48], 1)  # [n, 8, 32]: plane s is bit 4 of sub-block s
    return _k_affine(blocks, _q4_k_codes(blocks[:, 48:176]) | (high << 4))


def _crumbs(packed: torch.Tensor, runs: int) -> torch.Tensor:
    """2-bit codes: `runs` runs of 32 bytes, each run four sub-groups of 32 -> [n, runs * 4, 32]."""
    return _bit_planes(packed.reshape(-1, runs, 32), 2).reshape(-1, runs * 4, 32)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    packed_scales = blocks[:, 0:16]
    d = (_half(blocks, 80) * (packed_scales & 0x0F).float()).unsqueeze(-1)
    m = (_half(blocks, 82) * (packed_scales >> 4).float()).unsqueeze(-1)
    q = _crumbs(blocks[:, 16:80], 2).reshape(-1, 16, 16).float()
    return (d * q - m).reshape(-1, QK_K)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """12 bytes -> sixteen signed 6-bit scales [n, 16]: low nibbles from bytes 0-7 (all low
    nibbles, then all high), the top 2 bits from bytes 8-11 (2-bit planes in turn)."""
    low = _nibbles(packed[:, 0:8])
    high = _bit_planes(packed[:, 8:12], 2).reshape(-1, 16)
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    d = (_half(blocks, 108) * _q3_k_scales(blocks[:, 96:108])).unsqueeze(-1)
    low = _crumbs(blocks[:, 32:96], 2).reshape(-1, 16, 16)
    mask = _bit_planes(blocks[:, 0:32], 1).reshape(-1, 16, 16)  # a set bit means no -4 offset
    q = low.to(torch.int8) - ((mask ^ 1) << 2).to(torch.int8)
    return (d * q.float()).reshape(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    high = _crumbs(blocks[:, 128:192], 2)
    q = (low | (high << 4)).to(torch.int8) - 32
    d = (_half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return (d * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


_BLOCK_DECODERS: dict[QT, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.F32: _f32, QT.F16: _f16, QT.BF16: _bf16,
    QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1, QT.Q8_0: _q8_0,
    QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[QT] = frozenset(_BLOCK_DECODERS)


def check_supported(qtype: QT | int) -> QT:
    """The qtype as an enum member; ValueError naming it when it has no dequantizer here."""
    try:
        qtype = QT(qtype)
    except ValueError:
        raise ValueError(f"unknown GGML tensor type id {qtype}") from None
    if qtype not in _BLOCK_DECODERS:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}; supported: {names}")
    return qtype


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `raw`; read-only arrays (e.g. memmaps) are viewed, never written."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            raw = torch.from_numpy(np.ascontiguousarray(raw))
    return raw.contiguous().reshape(-1).view(torch.uint8)


def dequantize(
    raw: np.ndarray | torch.Tensor,
    qtype: QT | int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Raw bytes of one tensor (any shape, read as uint8) -> a new tensor of `shape`.

    `shape` is in row-major (numpy / torch) order, i.e. GGUF's dimension list reversed. Values
    are computed in float32 and then rounded to `dtype`, exactly as `.to(dtype)` would.

    The work runs in chunks of under 32768 elements. Temporaries then stay in cache, and every
    torch op stays below the intra-op grain size, so it runs on the calling thread. That matters on
    a busy machine: thousands of small OpenMP-parallel ops, each ending in a spinning barrier while
    another process holds the second core, took 70 s instead of 0.8 s for the default model.
    """
    qtype = check_supported(qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = _as_bytes(raw)
    numel = int(np.prod(shape, dtype=np.int64))
    if numel % block_size or data.numel() != numel // block_size * type_size:
        raise ValueError(
            f"{qtype.name} tensor of shape {tuple(shape)} needs {numel // block_size * type_size} "
            f"bytes in whole {block_size}-element blocks, got {data.numel()}"
        )
    blocks = data.reshape(-1, type_size)
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype)
    decode = _BLOCK_DECODERS[qtype]
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = decode(blocks[start:start + step])
    return out.reshape(tuple(shape))
