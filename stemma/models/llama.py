"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): pre-norm blocks, gated SiLU MLP."""
from __future__ import annotations

import torch
from torch import nn

from stemma.models.causal_lm import CausalLM
from stemma.models.layers import Attention, ForwardContext, GatedMLP, RMSNorm
from stemma.registry import MODEL_FAMILIES


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec, attn_layer, rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, attn_layer, rotary, norm_offset=0.0)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.activation, spec.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ops = ctx.ops
        x = x + self.self_attn(self.input_layernorm(x, ops), ctx)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)


@MODEL_FAMILIES.register("llama")
class LlamaForCausalLM(CausalLM):
    def __init__(self, spec, config):
        super().__init__(spec, config, LlamaDecoderLayer)
