"""The row-wise work between a forward's matmuls and its attention: the norms (a residual add
before one), q/k norm with rope, and the MLP's activation. Each is a plain function of tensors,
used as it is (`EAGER`), or compiled by Inductor with every size dynamic (`compiled_row_ops`).

Eager, each is a chain of float32 passes over the activations (a cast, a square, a mean, a
scale, a cast back). In a prefill of thousands of rows the activations do not stay in cache, and
these passes took most of the forward: 60% of a 2,300-token prefill of the default model on 2
cores, its matmuls 22%. Compiled, each chain is one loop over the rows. A one-row decode gains
nothing (its compiled forward fuses these already, `executor.compiled_decode`), so which rows use
the compiled functions is measured (`executor.compiled_rows`).

Invariant: the compiled and the eager function are the same code, so they compute the same
thing, with the same casts (`emulate_precision_casts`); only the rounding of the float32
reductions may differ.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F


def norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim, times `scale` (float32), in float32; then x's dtype
    (Gemma's `(1 + w)` form: the scale applies before the cast back)."""
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def norm_after(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to x's dtype, then times `weight` (Llama's form)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def add_norm(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x + norm(y): a residual add after a (post-)norm."""
    return x + norm(y, scale, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] (float32) with `layers.Rotary.cos_sin`'s factors."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), sin)


def qk_rope(qk: torch.Tensor, scale: torch.Tensor | None, eps: float, cos: torch.Tensor,
            sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q and k heads side by side [T, H, D]: q/k-normed in float32 with per-head `scale`
    [H, D] (None: no q/k norm), rotated, cast to `dtype`."""
    x = F.rms_norm(qk.float(), (qk.shape[-1],), None, eps) * scale if scale is not None else qk.float()
    return rope(x, cos, sin).to(dtype)


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(gate) * up, the gated MLP's middle."""
    return act(gate) * up


@dataclass(frozen=True)
class RowOps:
    norm: Callable = norm
    norm_after: Callable = norm_after
    add_norm: Callable = add_norm
    qk_rope: Callable = qk_rope
    act_mul: Callable = act_mul


EAGER = RowOps()
RECOMPILE_LIMIT = 64  # graphs per function: a layout, dtype or model each may add one


@functools.cache  # once per process: Dynamo keeps its graphs per function anyway
def compiled_row_ops() -> RowOps:
    """`EAGER`'s functions compiled by Inductor, every size dynamic (one graph serves every row
    count and model; a size of 1 is specialized, as Dynamo does). Nothing compiles here: the
    first call of each does."""
    def compile_(fn: Callable) -> Callable:
        # not fullgraph: past the recompile limit (engines of many models and dtypes in one
        # process) a call must run eager, not raise in a step, as fullgraph makes it do.
        # emulate_precision_casts: each cast back to bf16 rounds as it does eager (Inductor
        # otherwise keeps float32 through the multiply or add after it: a quarter of a bf16
        # norm's outputs differed)
        return torch.compile(fn, dynamic=True, recompile_limit=RECOMPILE_LIMIT,
                             options={"emulate_precision_casts": True})
    return RowOps(**{f.name: compile_(getattr(EAGER, f.name)) for f in fields(RowOps)})
