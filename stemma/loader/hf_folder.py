"""Reading a Hugging Face model folder: config.json, single or sharded *.safetensors, tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").exists():  # as transformers picks it (beside, say, mistral's
        return [folder / "model.safetensors"]     # consolidated.safetensors of another layout)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    return files


def read_tensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in safetensor_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).to(dtype)
    return tensors


def read_config(folder: Path):
    from transformers import AutoConfig
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: config.json not found")
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)

