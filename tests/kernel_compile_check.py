"""Compiles every stemma kernel for a CUDA GPU (sm_90), on a machine that has none.

The Triton interpreter runs a kernel's Python, not Triton's compiler, so it misses what only the
compiler rejects (a global that is not a constexpr, an unsupported construct, a bad layout). This
script calls each launcher on CPU tensors with its kernel launch intercepted, then compiles the
launch it would have made, through PTX to a cubin. Run it without TRITON_INTERPRET:

    python tests/kernel_compile_check.py
"""
from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from stemma.kernels import decode_attention, extend_attention, kv_write, rmsnorm, rotary  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                 torch.int32: "*i32", torch.int64: "*i64"}


class Intercepted:
    """Stands in for a kernel: records each launch instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.__name__ = kernel.__name__
        self.launches: list[tuple[tuple, dict, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, **constexprs):
            self.launches.append((args, constexprs, {"num_warps": num_warps, "num_stages": num_stages}))
        return launch


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def compile_launch(kernel, args: tuple, constexprs: dict, options: dict):
    names = kernel.arg_names
    types = dict(zip(names, map(arg_type, args)))
    signature = {name: types.get(name, "constexpr") for name in names}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)


def intercept(module, kernel_names: list[str]) -> list[Intercepted]:
    """Patches the module's kernels and its launch check; returns the interceptors."""
    module.check_launchable = lambda *_: None
    stubs = []
    for name in kernel_names:
        stubs.append(Intercepted(getattr(module, name)))
        setattr(module, name, stubs[-1])
    return stubs


def launch_all() -> list[Intercepted]:
    stubs = intercept(extend_attention, ["_extend_attention_kernel"])
    stubs += intercept(decode_attention, ["_decode_split_kernel", "_decode_merge_kernel"])
    stubs += intercept(kv_write, ["_kv_write_kernel"])
    stubs += intercept(rmsnorm, ["_rmsnorm_kernel"])
    stubs += intercept(rotary, ["_rotary_kernel"])
    ints = torch.zeros(4, dtype=torch.int64)
    table = torch.zeros((4, 64), dtype=torch.int32)
    for dtype, hq, hkv, d, window, cap in [(torch.bfloat16, 32, 8, 128, None, None),
                                           (torch.bfloat16, 8, 4, 256, 512, 50.0),
                                           (torch.float32, 4, 1, 80, 7, None)]:
        q, buf = torch.zeros((9, hq, d), dtype=dtype), torch.zeros((17, hkv, d), dtype=dtype)
        extend_attention.extend_attention(q, buf, buf, table, ints, ints, ints, ints, d ** -0.5,
                                          sliding_window=window, logit_cap=cap, max_extend_len=9)
        decode_attention.decode_attention(q[:4], buf, buf, table, ints, ints, d ** -0.5,
                                          sliding_window=window, logit_cap=cap, max_seq_len=1000)
    k = torch.zeros((3, 8, 128), dtype=torch.bfloat16)
    kv_write.kv_write(k, k, ints[:3], torch.zeros((9, 8, 128), dtype=torch.bfloat16), k.new_zeros((9, 8, 128)))
    x = torch.zeros((3, 640), dtype=torch.bfloat16)
    rmsnorm.rmsnorm(x, x[0], 1e-6, residual=x, gemma=True)
    rotary.apply_rotary(torch.zeros((3, 32, 128), dtype=torch.bfloat16), k, ints[:3],
                        torch.zeros((10, 64)), torch.zeros((10, 64)))
    return stubs


def main() -> int:
    compiled = 0
    for stub in launch_all():
        assert stub.launches, f"{stub.__name__} was never launched"
        for args, constexprs, options in stub.launches:
            binary = compile_launch(stub.kernel, args, constexprs, options)
            assert binary.asm["cubin"], f"{stub.__name__}: no cubin"
            compiled += 1
    print(f"compiled {compiled} kernel launches for {TARGET.backend} sm_{TARGET.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
