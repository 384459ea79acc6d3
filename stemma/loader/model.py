"""Loading a model: the default GGUF, a GGUF file, or a Hugging Face folder, into stemma's models."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from stemma.models.spec import ModelSpec, spec_from_config
from stemma.registry import MODEL_FAMILIES
from stemma.text.tokenizer import load_tokenizer



@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None when the folder has none
    spec: ModelSpec
    source: str


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return names[dtype]


def build_model(config: PretrainedConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, ModelSpec]:
    spec = spec_from_config(config)
    with torch.device("meta"):
        model = MODEL_FAMILIES.get(spec.family)(spec, config)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(tensors)
    return model.eval().requires_grad_(False), spec


def read_checkpoint(path: Path, dtype: torch.dtype) -> tuple[
        PretrainedConfig, PreTrainedTokenizerBase | None, dict[str, torch.Tensor]]:
    """(config, tokenizer or None, HF-named tensors) from a GGUF file or a Hugging Face folder."""
    if path.is_file() and path.suffix == ".gguf":
        from stemma.loader.gguf.loader import load_gguf
        ckpt = load_gguf(path, dtype)
        return ckpt.config, ckpt.tokenizer, ckpt.tensors
    if path.is_dir():
        from stemma.loader import hf_folder
        config = hf_folder.read_config(path)
        spec_from_config(config)  # reject unsupported architectures before reading weights
        tensors = hf_folder.read_tensors(path, dtype)
        return config, load_tokenizer(str(path)), tensors
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    raise ValueError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face model folder")


def load_model(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu") -> LoadedModel:
    """Loads `path` (None: the default Gemma 3 270M GGUF) onto `device`."""
    if path is None:
        from stemma.loader.gguf.loader import default_model_path
        path = default_model_path()
    device = torch.device(device)
    dt = resolve_dtype(dtype, device)
    config, tokenizer, tensors = read_checkpoint(Path(path), dt)
    model, spec = build_model(config, tensors, dt, device)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, spec=spec, source=str(path))
