"""Tiny random Hugging Face checkpoints, built and saved inside the tests (nothing is downloaded)."""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
              initializer_range=0.35, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_config(arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    if arch == "llama":
        return LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                           rope_theta=500000.0)
    if arch == "mistral":
        return MistralConfig(**COMMON, sliding_window=8, head_dim=16)
    if arch == "qwen2":
        return Qwen2Config(**COMMON)
    if arch == "qwen3":
        return Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=24)
    if arch == "gemma3":
        return Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True}, head_dim=32,
                                sliding_window=8, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1000000.0}})
    raise ValueError(arch)


def build_tiny(arch: str, folder: Path, seed: int = 0, shard: bool = False, **config) -> Path:
    """`config`: fields set on the tiny config (max_position_embeddings=8192, ...)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    for name, value in config.items():
        setattr(cfg, name, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # Gemma's (1 + w) norms start at w = 0; perturb every norm so they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(folder), max_shard_size="60KB" if shard else "5GB")
    return folder
