"""Times each Triton kernel against its torch reference and, for attention, against
torch.nn.functional.scaled_dot_product_attention, on one CUDA GPU.

    python benchmarks/kernels.py            # needs CUDA; prints that and exits 0 without it
    python benchmarks/kernels.py --smoke    # tiny shapes on CPU under the Triton interpreter:
                                            # checks that the script runs, its times mean nothing

Workload (bf16): 64 requests of 2048 tokens each; each request's KV slots are a random
permutation of the pool, as after a long-running server's churn. Attention shapes are Llama-like
(32 query heads, 8 KV heads, head_dim 128) and Gemma-like (16 query heads, 8 KV heads, head_dim 256):
  decode    one new token per request, attending to 2048 keys
  prefill   2048 new tokens per request, no prefix
  extend    512 new tokens per request after a cached 1536-token prefix
SDPA gets the same K/V already gathered into contiguous [B, H, L, D] tensors, so its time leaves out
the slot indirection that the kernels pay for. Each time is the median of `--reps` runs after a
warm-up run; every kernel's output is checked against its reference before it is timed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class Row:
    op: str
    shape: str
    kernel_ms: float
    reference_ms: float
    sdpa_ms: float | None
    max_err: float


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # warm-up: compiles the kernel, fills the allocator
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass
class Scale:
    batch: int
    context: int
    extend: int        # new tokens per request in the extend workload
    hidden: int        # rmsnorm width
    attention: list    # (Hq, Hkv, head_dim)
    reps: int


FULL = Scale(batch=64, context=2048, extend=512, hidden=4096, attention=[(32, 8, 128), (16, 8, 256)], reps=20)
SMOKE = Scale(batch=2, context=40, extend=9, hidden=80, attention=[(4, 1, 64), (4, 2, 80)], reps=1)


class Pool:
    """A scattered KV pool: request i's positions are slots of a random permutation."""

    def __init__(self, batch: int, context: int, hkv: int, d: int, device: torch.device):
        slots = batch * context
        self.k = torch.randn((slots + 1, hkv, d), dtype=torch.bfloat16, device=device)
        self.v = torch.randn((slots + 1, hkv, d), dtype=torch.bfloat16, device=device)
        perm = (torch.randperm(slots, device=device) + 1).to(torch.int32)
        self.table = perm.view(batch, context).contiguous()
        self.rows = torch.arange(batch, device=device)

    def gathered(self, length: int, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0:length as contiguous [B, Hq, L, D], for SDPA."""
        idx = self.table[:, :length].long()
        group = hq // self.k.shape[1]
        k = self.k[idx].transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        v = self.v[idx].transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        return k, v


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_decode(pool: Pool, hq: int, s: Scale, device: torch.device) -> Row:
    from stemma.kernels.decode_attention import decode_attention, decode_attention_reference
    d = pool.k.shape[2]
    q = torch.randn((s.batch, hq, d), dtype=torch.bfloat16, device=device)
    seq_lens = torch.full((s.batch,), s.context, device=device)
    args = (q, pool.k, pool.v, pool.table, pool.rows, seq_lens, d ** -0.5)
    kernel = lambda: decode_attention(*args, max_seq_len=s.context)  # noqa: E731
    reference = lambda: decode_attention_reference(*args)  # noqa: E731
    k, v = pool.gathered(s.context, hq)
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=d ** -0.5)  # noqa: E731
    return Row("decode", f"B{s.batch} L{s.context} {hq}:{pool.k.shape[1]} d{d}",
               time_ms(kernel, device, s.reps), time_ms(reference, device, s.reps),
               time_ms(sdpa, device, s.reps), max_err(kernel(), reference()))


def bench_extend(pool: Pool, hq: int, prefix: int, s: Scale, device: torch.device) -> Row:
    from stemma.kernels.extend_attention import extend_attention, extend_attention_reference
    d = pool.k.shape[2]
    new = s.context - prefix
    q = torch.randn((s.batch * new, hq, d), dtype=torch.bfloat16, device=device)
    lens = lambda n: torch.full((s.batch,), n, device=device)  # noqa: E731
    starts = torch.arange(s.batch, device=device) * new
    args = (q, pool.k, pool.v, pool.table, pool.rows, lens(prefix), lens(new), starts, d ** -0.5)
    kernel = lambda: extend_attention(*args, max_extend_len=new)  # noqa: E731
    reference = lambda: extend_attention_reference(*args)  # noqa: E731
    k, v = pool.gathered(s.context, hq)
    qb = q.view(s.batch, new, hq, d).transpose(1, 2)
    mask = torch.ones((new, s.context), dtype=torch.bool, device=device).tril(diagonal=prefix)
    sdpa = lambda: F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=d ** -0.5)  # noqa: E731
    name = "prefill" if prefix == 0 else "extend"
    return Row(name, f"B{s.batch} {prefix}+{new} {hq}:{pool.k.shape[1]} d{d}",
               time_ms(kernel, device, s.reps), time_ms(reference, device, s.reps),
               time_ms(sdpa, device, s.reps), max_err(kernel(), reference()))


def bench_small_ops(s: Scale, device: torch.device) -> list[Row]:
    from stemma.kernels.kv_write import kv_write, kv_write_reference
    from stemma.kernels.rmsnorm import rmsnorm, rmsnorm_reference
    from stemma.kernels.rotary import apply_rotary, apply_rotary_reference
    tokens = s.batch * s.extend
    hq, hkv, d = s.attention[0]

    def randn(*shape):
        return torch.randn(shape, dtype=torch.bfloat16, device=device)

    def row(op, shape, kernel, reference, err):
        return Row(op, shape, time_ms(kernel, device, s.reps), time_ms(reference, device, s.reps), None, err)

    x, res, w = randn(tokens, s.hidden), randn(tokens, s.hidden), randn(s.hidden)
    norm = lambda: rmsnorm(x, w, 1e-6, residual=res)  # noqa: E731
    norm_ref = lambda: rmsnorm_reference(x, w, 1e-6, residual=res)  # noqa: E731
    rows = [row("rmsnorm+residual", f"T{tokens} H{s.hidden}", norm, norm_ref, max_err(norm()[0], norm_ref()[0]))]

    q, k = randn(tokens, hq, d), randn(tokens, hkv, d)
    positions = torch.randint(0, s.context, (tokens,), device=device)
    cos, sin = randn(s.context, d // 2).float(), randn(s.context, d // 2).float()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(q, k, positions, cos, sin)
    apply_rotary_reference(q_ref, k_ref, positions, cos, sin)
    rows.append(row("rotary", f"T{tokens} {hq}:{hkv} d{d}", lambda: apply_rotary(q, k, positions, cos, sin),
                    lambda: apply_rotary_reference(q_ref, k_ref, positions, cos, sin),
                    max(max_err(q, q_ref), max_err(k, k_ref))))

    slots = torch.randperm(tokens * 2, device=device)[:tokens] + 1
    bufs = [torch.zeros((tokens * 2 + 1, hkv, d), dtype=torch.bfloat16, device=device) for _ in range(4)]
    write = lambda: kv_write(k, k_ref, slots, bufs[0], bufs[1])  # noqa: E731
    write_ref = lambda: kv_write_reference(k, k_ref, slots, bufs[2], bufs[3])  # noqa: E731
    write(), write_ref()
    rows.append(row("kv_write", f"T{tokens} {hkv}x{d}", write, write_ref,
                    max(max_err(bufs[0], bufs[2]), max_err(bufs[1], bufs[3]))))
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'op':<17} {'shape':<28} {'triton ms':>10} {'torch ms':>10} {'torch/triton':>13} "
          f"{'sdpa ms':>9} {'sdpa/triton':>12} {'max err':>9}")
    for r in rows:
        sdpa = f"{'-':>9} {'-':>12}" if r.sdpa_ms is None else f"{r.sdpa_ms:9.3f} {r.sdpa_ms / r.kernel_ms:12.2f}"
        print(f"{r.op:<17} {r.shape:<28} {r.kernel_ms:10.3f} {r.reference_ms:10.3f} "
              f"{r.reference_ms / r.kernel_ms:13.2f} {sdpa} {r.max_err:9.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first stemma.kernels import
        scale, device = SMOKE, torch.device("cpu")
    elif torch.cuda.is_available():
        scale, device = FULL, torch.device("cuda")
    else:
        print("benchmarks/kernels.py needs a CUDA GPU, and none is visible; nothing was measured.")
        return 0
    if args.reps:
        scale.reps = args.reps
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}; bf16; {scale.batch} requests x {scale.context} tokens, scattered slots; "
          f"median of {scale.reps} runs")
    rows = []
    for hq, hkv, d in scale.attention:
        pool = Pool(scale.batch, scale.context, hkv, d, device)
        rows.append(bench_decode(pool, hq, scale, device))
        rows.append(bench_extend(pool, hq, 0, scale, device))
        rows.append(bench_extend(pool, hq, scale.context - scale.extend, scale, device))
        del pool
    rows += bench_small_ops(scale, device)
    print_table(rows)
    print("torch = the kernel's plain torch reference; sdpa = scaled_dot_product_attention on pre-gathered,\n"
          "contiguous K/V (no slot indirection); ratios > 1 mean the Triton kernel is faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
