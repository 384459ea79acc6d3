"""A decoder-only causal LM over stemma's flattened batch, with Hugging Face parameter names.

Families differ only in their decoder layer (`llama.py`, `gemma3.py`); the embedding, the stack,
the final norm, the logits and weight loading live here.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from stemma.attention.base import AttentionLayer
from stemma.models.layers import ForwardContext, RMSNorm, Rotary
from stemma.models.linear import Embedding, Linear, Matrix
from stemma.models.spec import ModelSpec

# HF parameter name suffix -> (stemma parameter suffix, shard index within the stacked tensor)
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_PREFIXES = ("language_model.model.", "model.language_model.", "model.")


class DecoderStack(nn.Module):
    def __init__(self, spec: ModelSpec, layers: list[nn.Module], norm_offset: float):
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, norm_offset)


class CausalLM(nn.Module):
    norm_offset = 0.0

    def __init__(self, spec: ModelSpec, config: PretrainedConfig, make_layer: Callable[..., nn.Module]):
        super().__init__()
        self.spec = spec
        with torch.device("cpu"):  # real tensors even when the model is built on the meta device
            rotaries = {key: Rotary(config, spec.head_dim, key) for key in set(spec.layer_rope_keys)}
        layers = [make_layer(spec, self.attention_layer(i), rotaries[spec.layer_rope_keys[i]])
                  for i in range(spec.num_layers)]
        self.model = DecoderStack(spec, layers, self.norm_offset)
        self.tp = None  # a rank of a tensor-parallel model (models.parallel.parallelize)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def attention_layer(self, i: int) -> AttentionLayer:
        s = self.spec
        return AttentionLayer(layer_id=i, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                              head_dim=s.head_dim, scale=s.attention_scale,
                              sliding_window=s.layer_windows[i], logit_cap=s.attn_logit_softcap)

    def output_matrix(self) -> Matrix:
        """The vocabulary projection: the embedding itself when tied (one copy of the matrix)."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def matrices(self) -> dict[str, Matrix]:
        """Every weight matrix by module name: the ones a loader may quantize."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Matrix)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.spec.embed_scale is not None:
            h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)
        return h

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Logits at `ctx.batch.logits_indices`, shape [K, vocab], in the model dtype (float32
        when soft-capped); the sampler casts what it needs. On CPU they may be a transposed view
        (see `models.linear`)."""
        ctx.backend.begin(ctx.batch)
        h = self.embed(ctx.batch.input_ids)
        if ctx.decoder is None:
            h = self.model.norm(self.decoder(h, ctx)[ctx.batch.logits_indices])  # a few rows, often one
        else:  # every row has logits, in order: a graph serves one new token per request
            # (CompiledDecode.bucket), and each request's last new token has logits (ForwardBatch.build)
            h = ctx.decoder(h, ctx)
        logits = self.output_matrix().matmul(h)
        if self.tp is not None:  # each rank's vocabulary slice, joined (the padding cut off)
            logits = self.tp.all_gather_last(logits)[:, :self.spec.vocab_size]
        cap = self.spec.final_logit_softcap
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits

    def decoder(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The decoder layers over the embedded tokens (what a compiled forward replaces)."""
        for layer in self.model.layers:
            h = layer(h, ctx)
        return h

    def decode_rows(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The decoder layers, then the final norm, over every row: what a compiled decode
        forward replaces (`ForwardContext.decoder`)."""
        return self.model.norm(self.decoder(h, ctx))

    # ---- weights ----
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies HF-named tensors in; every parameter must be covered, with matching shapes."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for hf_name, tensor in tensors.items():
            name, shard = self._map_name(hf_name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the {self.spec.model_type} model")
            target = params[name].data
            if shard is not None:
                sizes = self._shard_sizes(name)
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, "
                                 f"model expects {tuple(target.shape)}")
            target.copy_(tensor)
            filled[name] = filled.get(name, 0) + 1
        for module in self.modules():  # scales cached from the weights are made again
            if hasattr(module, "forget_cached"):
                module.forget_cached()
        missing = [n for n in params if filled.get(n, 0) != self._expected_fills(n)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))

    def _map_name(self, hf_name: str) -> tuple[str | None, int | None]:
        if "rotary_emb" in hf_name:
            return None, None
        if hf_name.startswith("lm_head."):
            return (None, None) if self.lm_head is None else (hf_name, None)
        for prefix in _PREFIXES:
            if hf_name.startswith(prefix):
                hf_name = "model." + hf_name[len(prefix):]
                break
        for suffix, (target, shard) in _STACKED.items():
            marker = f".{suffix}."
            if marker in hf_name:
                return hf_name.replace(marker, f".{target}."), shard
        return hf_name, None

    def _shard_sizes(self, name: str) -> list[int]:
        s = self.spec
        if ".qkv_proj." in name:
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [s.intermediate_size, s.intermediate_size]

    @staticmethod
    def _expected_fills(name: str) -> int:
        if ".qkv_proj." in name:
            return 3
        if ".gate_up_proj." in name:
            return 2
        return 1
