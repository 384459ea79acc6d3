"""Gemma 3 text: sandwich norms with (1 + w) weights, scaled embeddings, GELU-tanh MLP,
q/k norm, and sliding-window layers with their own rope base."""
from __future__ import annotations

import torch
from torch import nn

from stemma.models.causal_lm import CausalLM
from stemma.models.layers import Attention, ForwardContext, GatedMLP, RMSNorm
from stemma.registry import MODEL_FAMILIES


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec, attn_layer, rotary):
        super().__init__()
        eps, d = spec.rms_norm_eps, spec.hidden_size
        self.input_layernorm = RMSNorm(d, eps, offset=1.0)
        self.self_attn = Attention(spec, attn_layer, rotary, norm_offset=1.0)
        self.post_attention_layernorm = RMSNorm(d, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, offset=1.0)
        self.mlp = GatedMLP(d, spec.intermediate_size, spec.activation, bias=False)
        self.post_feedforward_layernorm = RMSNorm(d, eps, offset=1.0)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ops = ctx.ops
        x = self.post_attention_layernorm.add_to(x, self.self_attn(self.input_layernorm(x, ops), ctx), ops)
        return self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x, ops), ops), ops)


@MODEL_FAMILIES.register("gemma3")
class Gemma3ForCausalLM(CausalLM):
    norm_offset = 1.0

    def __init__(self, spec, config):
        super().__init__(spec, config, Gemma3DecoderLayer)
