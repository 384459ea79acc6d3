"""Triton, if it is installed, behind names that never fail to import.

Kernel modules take `tl` and `jit` from here, so `import stemma.kernels.x` works without Triton;
launching a kernel then raises a clear error. Kernel modules use `from __future__ import
annotations`, so `tl.constexpr` annotations are strings that Triton reads and Python never
evaluates.

Triton picks its interpreter (`TRITON_INTERPRET=1`) when a kernel is decorated, that is when its
module is first imported: set the variable before that to run the kernels on CPU tensors.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the kernels stay importable; launching them raises
    triton = tl = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("stemma's Triton kernels need the `triton` package, which failed to import: "
                           f"{_IMPORT_ERROR}")


class _Unavailable:
    """Stands in for a kernel when Triton is missing; launching it raises."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getitem__(self, grid):
        require_triton()


def jit(fn):
    return _Unavailable(fn.__name__) if triton is None else triton.jit(fn)


# The Triton interpreter has two bf16 gaps: tl.dot multiplies bf16 operands as raw 16-bit integers,
# and fp32 -> bf16 casts truncate where compiled Triton rounds to nearest even. Kernels take an
# INTERPRETED constexpr (launchers set it from `is_interpreted`) and call `dot` and `cast`, which
# give the compiled results under the interpreter and are plain tl.dot / .to() when compiled.

@jit
def dot(a, b, INTERPRETED: tl.constexpr):
    """tl.dot with fp32 accumulation. Under the interpreter it multiplies fp32 copies of the
    operands: the same result, since products of bf16/fp16 values are exact in fp32."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@jit
def cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """x.to(dtype), rounding to nearest even; under the interpreter bf16 is rounded on the bits."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


def is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """Raises unless `kernel` can run on these tensors: CUDA tensors, or the Triton interpreter."""
    require_triton()
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{kernel.__name__}: tensors on several devices: {sorted(map(str, devices))}")
    if not (devices.pop().type == "cuda" or is_interpreted(kernel)):
        raise RuntimeError(f"{kernel.__name__} runs on CUDA tensors, or on CPU tensors under the Triton "
                           "interpreter (TRITON_INTERPRET=1 set before stemma.kernels is imported)")


def check_int_vector(t: torch.Tensor, name: str, length: int) -> None:
    """Raises unless `t` is a [length] tensor of integers."""
    if t.is_floating_point():
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.shape != (length,):
        raise ValueError(f"{name} must be [{length}], got {tuple(t.shape)}")


def check_last_dim_contiguous(what: str, *tensors: torch.Tensor) -> None:
    """Raises unless every tensor's last dim is contiguous (the kernels index it with stride 1)."""
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{what} must be contiguous")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
