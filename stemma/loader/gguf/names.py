"""GGUF tensor names -> Hugging Face parameter names, and the value fixes llama.cpp needs undone.

The names follow Hugging Face's `Gemma3ForCausalLM` / `LlamaForCausalLM` state dicts, so a
checkpoint loaded here matches the one transformers' own GGUF loader builds. llama.cpp's
converter changes two things on the way in, and transformers undoes both:

- gemma3: RMSNorm weights are stored as `w + 1` (Gemma's norm multiplies by `1 + w`); every
  tensor whose name contains `norm.weight` gets 1 subtracted, in float32.
- llama: the rows of `attn_q` / `attn_k` are permuted from the HF half-split rotary layout to the
  interleaved one (per head: `[0, d/2, 1, d/2 + 1, ...]`); the inverse permutation is applied.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("gemma3", "llama")

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_LAYER_BY_ARCH = {
    "gemma3": {
        **_LAYER_COMMON,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "llama": {
        **_LAYER_COMMON,
        "ffn_norm": "post_attention_layernorm",
    },
}

# Present in some files, with no parameter in the HF model (transformers skips them too):
# llama 3's rope_freqs holds the rope scaling factors, which gguf.config puts in the config.
_IGNORED = {"rope_freqs.weight"}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)")


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def hf_name(architecture: str, gguf_name: str) -> str | None:
    """The HF parameter name for `gguf_name`, or None for a tensor HF has no parameter for.

    Raises ValueError for a name this architecture does not know, rather than dropping weights.
    """
    check_architecture(architecture)
    if gguf_name in _IGNORED:
        return None
    if match := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        module = _LAYER_BY_ARCH[architecture].get(part)
        if module is not None:
            return f"model.layers.{layer}.{module}.{kind}"
    elif (match := _TOP_NAME.fullmatch(gguf_name)) and match.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[match.group(1)]}.{match.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name for architecture {architecture!r}")


def _unpermute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's per-head rotary row interleave (shape is preserved)."""
    half = weight.shape[0] // n_head // 2
    grouped = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def value_fix(architecture: str, gguf_name: str, config: PretrainedConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The float32 -> float32 correction for this tensor, or None when it is stored as HF has it."""
    check_architecture(architecture)
    if architecture == "gemma3" and "norm.weight" in gguf_name:
        return lambda weight: weight - 1
    if architecture == "llama":
        if ".attn_q." in gguf_name:
            return lambda weight: _unpermute_rows(weight, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return lambda weight: _unpermute_rows(weight, config.num_key_value_heads)
    return None
