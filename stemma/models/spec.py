"""ModelSpec: the architecture facts stemma's models need, read once from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type -> (architecture family: a stemma.registry.MODEL_FAMILIES name, q/k/v bias, q/k norm)
_FAMILIES = {
    "llama": ("llama", False, False),
    "mistral": ("llama", False, False),
    "qwen2": ("llama", True, False),
    "qwen3": ("llama", False, True),
    "gemma3_text": ("gemma3", False, True),
}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str
    attention_scale: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...]   # sliding window of each layer, None = full attention
    layer_rope_keys: tuple[str | None, ...]  # which rope_parameters entry each layer uses
    attn_logit_softcap: float | None
    final_logit_softcap: float | None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if len(self.layer_windows) != self.num_layers:
            raise ValueError("layer_types must name every layer")

    @property
    def embed_scale(self) -> float | None:
        return self.hidden_size ** 0.5 if self.family == "gemma3" else None


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_types(config: PretrainedConfig, model_type: str, n: int) -> list[str]:
    """Each layer's attention. Only mistral slides every layer by `sliding_window` alone, as
    transformers reads it (qwen2/qwen3 and gemma3 configs name their layer_types; llama's ignores
    the key: a stray one made every layer sliding here)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    slides = model_type == "mistral" and getattr(config, "sliding_window", None)
    return ["sliding_attention" if slides else "full_attention"] * n


def check_rope(config: PretrainedConfig, keys: set[str | None]) -> None:
    params = getattr(config, "rope_parameters", None) or {}
    for key in keys:
        entry = params.get(key, {}) if key else params
        rope_type = (entry or {}).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")


def spec_from_config(config: PretrainedConfig) -> ModelSpec:
    if _text_config(config) is not config:
        raise ValueError(f"{config.model_type!r} is a multimodal checkpoint "
                         f"({', '.join(getattr(config, 'architectures', None) or ['its vision tower'])}); "
                         "stemma runs text-only models: use the text-only release of the model")
    model_type = config.model_type
    if model_type == "gemma3":
        model_type = "gemma3_text"
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported architecture {model_type!r}; stemma supports "
                         f"{', '.join(sorted(_FAMILIES))}")
    family, qkv_bias, qk_norm = _FAMILIES[model_type]
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_type!r} with use_bidirectional_attention (an embedding model) is "
                         "not a causal language model; stemma runs causal ones")
    types = _layer_types(config, model_type, n)
    windows = tuple(window if t == "sliding_attention" and window else None for t in types)
    per_type_rope = family == "gemma3"
    rope_keys = tuple(t if per_type_rope else None for t in types)
    check_rope(config, set(rope_keys))
    scalar = getattr(config, "query_pre_attn_scalar", None) if family == "gemma3" else None
    return ModelSpec(
        model_type=model_type,
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        attention_scale=(scalar or head_dim) ** -0.5,
        qkv_bias=qkv_bias or bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        qk_norm=qk_norm,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings,
        layer_windows=windows,
        layer_rope_keys=rope_keys,
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it
        attn_logit_softcap=None if family == "gemma3" else getattr(config, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
    )
