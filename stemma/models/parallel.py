"""Tensor parallelism inside the model (`tp` ranks, one engine): which slice of every matrix a
rank holds, and the collectives that join the slices.

    qkv_proj, gate_up_proj   column-parallel: a rank holds its heads' / its intermediate rows
    o_proj, down_proj        row-parallel: a rank holds the matching input columns; the partial
                             outputs are summed over the ranks (all-reduce), the bias added once
    embed_tokens, lm_head    vocab-parallel: a rank holds ceil(vocab / tp) rows (the last rank's
                             tail zero-padded); a lookup takes each token from the rank that holds
                             it (all-reduce of the masked rows); logits are gathered (all-gather)
    norms, rotary            replicated

Query heads split evenly. KV heads split evenly too when there are at least as many as ranks;
with fewer, each rank holds the one KV head its query heads read (replicated across the ranks
that share it). The slicing happens on the checkpoint's dense tensors, before any quantization,
so the int8 and int4 stores of a rank hold its slice only.

Collectives go through a c10d process group object (gloo on CPU, NCCL on CUDA), not the
process-global default group, so one process may hold several engines.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from stemma.models.spec import ModelSpec


@dataclass(eq=False)
class TensorParallel:
    rank: int
    size: int
    group: Any     # a torch.distributed ProcessGroup (ProcessGroupGloo / ProcessGroupNCCL)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks, in place (made contiguous first); returns it."""
        t = t.contiguous()
        self.group.allreduce([t]).wait()
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, joined along the last dim in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

    def split(self, n: int) -> tuple[int, int]:
        """(first, count) of this rank's even share of `n` (checked by `check`)."""
        return self.rank * (n // self.size), n // self.size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds."""
        if total >= self.size:
            return self.split(total)
        return self.rank * total // self.size, 1

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """(first, rows) of this rank's vocabulary slice, rows padded to ceil(vocab / size)."""
        per = -(-vocab // self.size)
        return self.rank * per, per


def check(spec: ModelSpec, size: int) -> None:
    """Raises ValueError when the model cannot split over `size` ranks."""
    problems = []
    if spec.num_heads % size:
        problems.append(f"its {spec.num_heads} query heads")
    kv = spec.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"its {kv} KV heads")
    if spec.intermediate_size % size:
        problems.append(f"its MLP width {spec.intermediate_size}")
    if problems:
        raise ValueError(f"tp={size} does not divide {' and '.join(problems)}; choose a tp that does")


def shard_spec(spec: ModelSpec, tp: TensorParallel) -> ModelSpec:
    """The spec of one rank's slice (the vocabulary stays whole: logits are gathered)."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // tp.size,
                               num_kv_heads=tp.kv_heads(spec.num_kv_heads)[1],
                               intermediate_size=spec.intermediate_size // tp.size)


def shard_tensors(tensors: dict[str, torch.Tensor], spec: ModelSpec,
                  tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slice of every HF-named checkpoint tensor."""
    d = spec.head_dim
    q0, nq = tp.split(spec.num_heads)
    k0, nk = tp.kv_heads(spec.num_kv_heads)
    i0, ni = tp.split(spec.intermediate_size)
    out = {}
    for name, t in tensors.items():
        kind = name.rsplit(".", 1)[-1]  # weight | bias
        if ".self_attn.q_proj." in name:
            t = t.narrow(0, q0 * d, nq * d)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            t = t.narrow(0, k0 * d, nk * d)
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            t = t.narrow(0, i0, ni)
        elif ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            if kind == "weight":
                t = t.narrow(1, *((q0 * d, nq * d) if "o_proj" in name else (i0, ni)))
            elif tp.rank:
                t = torch.zeros_like(t)  # the bias is added once, by rank 0, before the sum
        elif name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            t = _vocab_slice(t, *tp.vocab_rows(spec.vocab_size))
        out[name] = t.contiguous()
    return out


def row_absmax(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole rows' largest magnitudes of the row-parallel weights (o_proj, down_proj): an
    int8 slice takes its per-row scale from the whole row, as the unsplit matrix does, so that
    every rank's int8 weights are the unsplit ones'. int4 groups run along the rows, so a slice
    that is a multiple of the group size keeps the unsplit groups; a slice that is not (or a
    matrix the kernel does not take) falls back to int8 on that rank, whatever the unsplit
    matrix got."""
    return {name: t.float().abs().amax(dim=1) for name, t in tensors.items()
            if name.endswith((".self_attn.o_proj.weight", ".mlp.down_proj.weight"))}


def _vocab_slice(t: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    part = t[first:first + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    return part


def parallelize(model: Any, spec: ModelSpec, tp: TensorParallel) -> None:
    """Makes a model built from `spec` = `shard_spec(...)` (on the meta device, before its weights
    are loaded) one rank of `tp`: vocab-parallel embedding and output matrix, row-parallel sums."""
    from stemma.models.layers import Attention, GatedMLP
    from stemma.models.linear import Embedding, Linear
    first, rows = tp.vocab_rows(spec.vocab_size)
    model.model.embed_tokens = Embedding(rows, spec.hidden_size)
    model.model.embed_tokens.vocab = (first, tp)
    if model.lm_head is not None:
        model.lm_head = Linear(spec.hidden_size, rows, bias=False)
    for module in model.modules():
        if isinstance(module, Attention):
            module.o_proj.reduce = tp
        elif isinstance(module, GatedMLP):
            module.down_proj.reduce = tp
    model.tp = tp
