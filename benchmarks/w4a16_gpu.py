"""Times the W4A16 Triton matmul (stemma.kernels.w4a16_matmul) against bf16 F.linear on one CUDA GPU.

    python benchmarks/w4a16_gpu.py              # needs CUDA; says so and exits 0 without it
    python benchmarks/w4a16_gpu.py --smoke      # tiny shapes on CPU under the Triton interpreter:
                                                # checks that the script runs, its times mean nothing

Shapes are the default model's matrices, x [M, K] @ W^T with W [N, K]: the LM head (262144 x 640),
the MLP up/gate (2048 x 640) and down (640 x 2048) projections and the attention projection
(1024 x 640), for M = 1, 16 and 64 tokens. W is a random weight quantized with `quantize_w4`
(group 128 unless --group); F.linear gets that weight dequantized to bf16, so both compute the
same product and the error column is the kernel's against F.linear, relative to max |F.linear|.

Each CUDA time is triton.testing.do_bench's median (about --rep-ms of runs after a warm-up), which
evicts L2 before every run, as a decode step finds it: the model's weights, all layers together,
do not fit in L2. `bf16/w4a16` above 1 means the W4A16 kernel is the faster.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, timed  # noqa: E402

SHAPES = [(262144, 640), (2048, 640), (640, 2048), (1024, 640)]  # (N, K)
TOKENS = [1, 16, 64]
SMOKE_SHAPES = [(80, 256), (48, 128)]
SMOKE_TOKENS = [1, 7]


def time_us(fn, device: torch.device, rep_ms: int) -> float:
    if device.type != "cuda":
        return timed(fn, repeat=1, warmup=1) * 1e6
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--group", type=int, default=128, choices=(32, 64, 128))
    parser.add_argument("--rep-ms", type=int, default=100, help="how long do_bench times each case")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first stemma.kernels import
        device, shapes, tokens = torch.device("cpu"), SMOKE_SHAPES, SMOKE_TOKENS
    elif torch.cuda.is_available():
        device, shapes, tokens = torch.device("cuda"), SHAPES, TOKENS
    else:
        print("benchmarks/w4a16_gpu.py needs a CUDA GPU, and none is visible; nothing was measured "
              "(--smoke runs tiny shapes on CPU under the Triton interpreter).")
        return 0
    from stemma.kernels.w4a16_matmul import dequantize_w4, quantize_w4, w4a16_matmul

    torch.manual_seed(0)
    timing = "median times, L2 evicted before each run"
    if device.type != "cuda":
        timing = "one run each, under the interpreter: the times mean nothing"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}; bf16 activations, int4 weights in groups of {args.group}; {timing}")
    rows = []
    for n, k in shapes:
        weight = torch.randn((n, k), device=device) * k ** -0.5
        qweight, scales, zeros = quantize_w4(weight, args.group, torch.bfloat16)
        dense = dequantize_w4(qweight, scales, zeros, args.group)
        del weight
        weight_bytes = qweight.numel() + 2 * scales.numel() * scales.element_size()
        for m in tokens:
            x = torch.randn((m, k), dtype=torch.bfloat16, device=device)
            w4 = lambda: w4a16_matmul(x, qweight, scales, zeros, args.group)  # noqa: E731
            bf16 = lambda: F.linear(x, dense)  # noqa: E731
            expected = bf16().float()
            err = (w4().float() - expected).abs().max().item() / expected.abs().max().clamp(min=1e-30).item()
            w4_us, bf16_us = time_us(w4, device, args.rep_ms), time_us(bf16, device, args.rep_ms)
            gbps = (weight_bytes + 2 * m * (k + n)) / (w4_us * 1e-6) / 1e9
            rows.append([m, n, k, f"{w4_us:.1f}", f"{bf16_us:.1f}", f"{bf16_us / w4_us:.2f}", f"{gbps:.1f}",
                         f"{err:.2e}"])
        del qweight, scales, zeros, dense
    print(table(["M", "N", "K", "w4a16 us", "bf16 us", "bf16/w4a16", "w4a16 GB/s", "rel err"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
