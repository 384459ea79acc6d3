"""Loading a model: the default GGUF, a GGUF file, or a Hugging Face folder, into stemma's models."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from stemma.engine_config import QUANTIZATIONS
from stemma.loader import quantize
from stemma.models import parallel
from stemma.models.causal_lm import CausalLM
from stemma.models.parallel import TensorParallel
from stemma.models.spec import ModelSpec, spec_from_config
from stemma.progress import stage
from stemma.registry import MODEL_FAMILIES
from stemma.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None when the folder has none
    spec: ModelSpec
    source: str
    stores: dict[str, str] = field(default_factory=dict)  # matrix module name -> dense/int8/int4


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


def build_model(config: PretrainedConfig, spec: ModelSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, tp: TensorParallel | None = None) -> tuple[CausalLM, ModelSpec]:
    """The model of `spec` (config's) with `tensors` loaded; with `tp`, rank tp.rank's slice of it
    (`tensors` already sliced: models.parallel.shard_tensors) and the slice's spec."""
    if tp is not None:
        spec = parallel.shard_spec(spec, tp)
    stage(logger, "building the %s model (%d layers, %s, %s%s)", spec.model_type, spec.num_layers,
          str(dtype).removeprefix("torch."), device,
          f", rank {tp.rank} of tp={tp.size}" if tp is not None else "")
    with torch.device("meta"):
        model = MODEL_FAMILIES.get(spec.family)(spec, config)
        if tp is not None:
            parallel.parallelize(model, spec, tp)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(tensors)
    return model.eval().requires_grad_(False), spec


def read_checkpoint(path: Path, dtype: torch.dtype) -> tuple[
        PretrainedConfig, PreTrainedTokenizerBase | None, dict[str, torch.Tensor], dict[str, str] | None]:
    """(config, tokenizer or None, HF-named tensors, their GGUF types or None) from a GGUF file or
    a Hugging Face folder."""
    if path.is_file() and path.suffix == ".gguf":
        from stemma.loader.gguf.loader import load_gguf
        ckpt = load_gguf(path, dtype)
        return ckpt.config, ckpt.tokenizer, ckpt.tensors, ckpt.qtypes
    if path.is_dir():
        from stemma.loader import hf_folder
        config = hf_folder.read_config(path)
        spec_from_config(config)  # reject unsupported architectures before reading weights
        stage(logger, "reading the weights of %s", path)
        tensors = hf_folder.read_tensors(path, dtype)
        return config, load_tokenizer(str(path)), tensors, None
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    raise ValueError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face model folder")


def load_model(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", quantization: str = "none",
               int4_group_size: int = 64, tp: TensorParallel | None = None) -> LoadedModel:
    """Loads `path` (None: the default Gemma 3 270M GGUF) onto `device`, its matrices held as
    `quantization` says (see stemma.loader.quantize); with `tp`, this rank's slice of it."""
    if path is None:
        from stemma.loader.gguf.loader import default_model_path
        stage(logger, "locating the default model (Gemma 3 270M, from its PyPI package)")
        path = default_model_path()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    device = torch.device(device)
    dt = resolve_dtype(dtype, device)
    quantized = quantization in ("int8", "int4") or (
        quantization == "auto" and Path(path).suffix == ".gguf" and device.type == "cpu")
    if quantized and device.type != "cpu":
        raise ValueError(f"quantization={quantization} runs on CPU only (torch's weight-only kernels); "
                         f"use quantization=none on {device.type}")
    config, tokenizer, tensors, qtypes = read_checkpoint(Path(path), torch.float32 if quantized else dt)
    row_absmax = {}
    spec = spec_from_config(config)
    if tp is not None:
        parallel.check(spec, tp.size)
        row_absmax = parallel.row_absmax(tensors) if quantized else {}
        tensors = parallel.shard_tensors(tensors, spec, tp)
    model, spec = build_model(config, spec, tensors, torch.float32 if quantized else dt, device, tp)
    stores = {name: "dense" for name in model.matrices()}
    if quantized:
        stage(logger, "choosing the store of each weight matrix (quantization=%s)", quantization)
        row_absmax = {model._map_name(name)[0].removesuffix(".weight"): t for name, t in row_absmax.items()}
        stores = quantize.apply(model, quantize.plan(model, quantization, qtypes), dt, int4_group_size,
                                row_absmax)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, spec=spec, source=str(path),
                       stores=stores)
