"""What transformers' config of a GGUF file leaves out, put back as llama.cpp reads the file.

- `{arch}.rope.scaling.type` linear and its factor (Gemma 3 4B-27B scale their global layers'
  positions by 8): transformers' config keeps the default rope. Other scaling types are refused
  rather than run unscaled.
- `rope_freqs.weight` (every Llama 3.1-3.3 file): per-frequency divisors of the rope's inverse
  frequencies, which llama.cpp's converter computes from the llama3 rope scaling and stores in
  place of it. Kept as the config's `rope_freq_factors`, which models.layers.Rotary applies.
- Gemma 3's attention scale: the file has no `query_pre_attn_scalar`, and transformers' default
  (256) is right only where it equals the head size; llama.cpp scales the 27B (62 layers) by
  hidden / heads, as its release config does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from stemma.loader.gguf.index import GGUFIndex

ROPE_FREQS = "rope_freqs.weight"
GEMMA3_27B_LAYERS = 62


def complete(config: PretrainedConfig, index: GGUFIndex) -> None:
    """Sets what the file says and transformers' config left out (in place)."""
    if index.rope_scaling is not None:
        _scale_rope(config, index)
    if index.architecture == "gemma3":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        big = config.num_hidden_layers == GEMMA3_27B_LAYERS
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else head_dim


def _scale_rope(config: PretrainedConfig, index: GGUFIndex) -> None:
    kind, factor = index.rope_scaling
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear is); stemma would "
                         "run the model with its positions unscaled")
    params = dict(config.rope_parameters or {})
    if index.architecture == "gemma3":  # the global (full attention) layers; the local ones unscaled
        params["full_attention"] = {**params["full_attention"], "rope_type": "linear", "factor": factor}
    else:
        params.update(rope_type="linear", factor=factor)
    config.rope_parameters = params


def set_rope_freqs(config: PretrainedConfig, factors: list[float]) -> None:
    config.rope_freq_factors = factors
