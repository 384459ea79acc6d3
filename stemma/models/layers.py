"""The building blocks shared by stemma's decoder models."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from stemma.attention.base import AttentionBackend, AttentionLayer
from stemma.executor.forward_batch import ForwardBatch
from stemma.cache.kv_pool import KVPool
from stemma.models.linear import Linear
from stemma.models.row_ops import EAGER, RowOps

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass
class ForwardContext:
    """Everything a layer needs during one forward, passed explicitly (no global state)."""
    batch: ForwardBatch
    backend: AttentionBackend
    pool: KVPool
    rope_cache: dict = field(default_factory=dict)
    # a compiled CausalLM.decode_rows (a forward of one new token per request); None: eager layers
    decoder: Callable[[torch.Tensor, "ForwardContext"], torch.Tensor] | None = None
    ops: RowOps = EAGER   # the norms, rope and activation of the eager layers (models.row_ops)


class RMSNorm(nn.Module):
    """RMSNorm in float32. `offset=1.0` is Gemma's `(1 + w)` variant, applied before the cast back."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self._scale_of: tuple | None = None   # (weight, its version) that `_scale` was made from
        self._scale: torch.Tensor | None = None

    def forget_cached(self) -> None:
        self._scale_of = self._scale = None

    def scale(self) -> torch.Tensor:
        """`offset + weight` in float32, made again after a load (CausalLM.load_weights calls
        forget_cached: it copies through `.data`, which leaves the version alone) or when the
        weight tensor is replaced or changed in place."""
        # Dynamo's trace: the graph makes the scale from the weight it reads at each call (a
        # loop that Inductor fuses into the norm's), so it is never stale. Not is_compiling():
        # that is true on every thread while any compile runs, and eager forwards run beside the
        # background compile
        if torch.compiler.is_dynamo_compiling():
            return self._make_scale()
        key = (self.weight, self.weight._version)
        if self._scale_of is None or self._scale_of[0] is not key[0] or self._scale_of[1] != key[1]:
            self._scale = self._make_scale().contiguous()
            self._scale_of = key
        return self._scale

    def _make_scale(self) -> torch.Tensor:
        return self.offset + self.weight.detach().float()

    def forward(self, x: torch.Tensor, ops: RowOps = EAGER) -> torch.Tensor:
        if self.offset:
            return ops.norm(x, self.scale(), self.eps)
        return ops.norm_after(x, self.weight, self.eps)

    def add_to(self, x: torch.Tensor, y: torch.Tensor, ops: RowOps = EAGER) -> torch.Tensor:
        """x + self(y): a post-norm's residual add."""
        if self.offset:
            return ops.add_norm(x, y, self.scale(), self.eps)
        return x + ops.norm_after(y, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary embedding (NEOX, rotate-half layout) with inverse frequencies from transformers' rope
    table: its cos/sin factors (`row_ops.rope` applies them)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, rope_key: str | None):
        super().__init__()
        self.key = rope_key
        params = config.rope_parameters or {}
        entry = params[rope_key] if rope_key else params
        rope_type = entry.get("rope_type", "default")
        if rope_type == "default":
            base = entry["rope_theta"]
            exps = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
            inv_freq = 1.0 / (base ** exps)
            scaling = 1.0
        else:
            kwargs = {"layer_type": rope_key} if rope_key else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        factors = getattr(config, "rope_freq_factors", None)  # a GGUF file's rope_freqs (gguf.config)
        if factors is not None:
            if len(factors) != inv_freq.numel():
                raise ValueError(f"rope_freqs holds {len(factors)} factors for {inv_freq.numel()} frequencies")
            inv_freq = inv_freq / torch.tensor(factors, dtype=inv_freq.dtype)
        # a plain attribute, not a buffer: models are built on the meta device and then emptied
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width [T, 1, D] float32 factors: cos twice, and sin with the rotate-half sign
        folded in (-sin, then sin), so that rope(x) = x * cos + swap_halves(x) * sin."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are one stacked matmul."""

    def __init__(self, hidden: int, intermediate: int, activation: str, bias: bool):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}")
        self.act = _ACTIVATIONS[activation]
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ops: RowOps = EAGER) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(ops.act_mul(gate, up, self.act))


class Attention(nn.Module):
    """Self-attention over the KV pool: stacked qkv projection, optional q/k norm, rope, backend."""

    def __init__(self, spec, layer: AttentionLayer, rotary: Rotary, norm_offset: float):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.sizes = (hq * d, hkv * d, hkv * d)
        self.qkv_proj = Linear(spec.hidden_size, sum(self.sizes), bias=spec.qkv_bias)
        self.o_proj = Linear(hq * d, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self._qk_of: tuple | None = None   # the (q, k) norm scales `_qk` was made from
        self._qk: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        lay = self.layer
        hq, hkv, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
        qkv = self.qkv_proj(x)
        # q and k side by side as [T, Hq + Hkv, D]: normed and rotated together, in float32
        qk = qkv[:, :(hq + hkv) * d].reshape(n, hq + hkv, d)
        qk = self.rotated(qk, *rope_for(self.rotary, ctx), x.dtype, ctx.ops)
        v = qkv[:, (hq + hkv) * d:].reshape(n, hkv, d)
        out = ctx.backend.forward(qk[:, :hq], qk[:, hq:], v, lay, ctx.pool)
        return self.o_proj(out.reshape(n, hq * d))

    def rotated(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                ops: RowOps = EAGER) -> torch.Tensor:
        """q and k heads side by side [T, Hq + Hkv, D]: q/k-normed and rotated in float32, then `dtype`."""
        if self.q_norm is not None:
            return ops.qk_rope(qk, self.qk_scale(), self.q_norm.eps, cos, sin, dtype)
        return ops.qk_rope(qk, None, 0.0, cos, sin, dtype)

    def forget_cached(self) -> None:
        self._qk_of = self._qk = None

    def qk_scale(self) -> torch.Tensor:
        """[Hq + Hkv, D]: each query head's q-norm scale, then each KV head's k-norm scale."""
        q, k = self.q_norm.scale(), self.k_norm.scale()
        if torch.compiler.is_dynamo_compiling():  # made in the graph from the weights (RMSNorm.scale)
            return self._stack_scales(q, k)
        if self._qk_of is None or self._qk_of[0] is not q or self._qk_of[1] is not k:
            self._qk = self._stack_scales(q, k)
            self._qk_of = (q, k)
        return self._qk

    def _stack_scales(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.cat((q.expand(self.layer.num_heads, -1), k.expand(self.layer.num_kv_heads, -1)))


def rope_for(rotary: Rotary, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of this batch's positions, computed once per rotary per forward."""
    if rotary.key not in ctx.rope_cache:
        ctx.rope_cache[rotary.key] = rotary.cos_sin(ctx.batch.positions)
    return ctx.rope_cache[rotary.key]
