"""Where each tensor of a GGUF file lives: name, type, shape and byte range.

Parsing a GGUF header with `gguf.GGUFReader` reads every metadata value, including the whole
vocabulary, which takes seconds for a 262k-token model. The index keeps only what loading the
weights needs, so it is built once (cold) and stored as JSON beside the cached config.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: `shape` is row-major (GGUF's dimension list reversed); `offset` is absolute."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "qtype": self.qtype.name, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, data: dict) -> "TensorEntry":
        return cls(data["name"], gguf.GGMLQuantizationType[data["qtype"]], tuple(data["shape"]),
                   data["offset"], data["nbytes"])


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> str:
        return json.dumps({"architecture": self.architecture,
                           "tensors": [t.to_json() for t in self.tensors]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "GGUFIndex":
        data = json.loads(text)
        return cls(data["architecture"], tuple(TensorEntry.from_json(t) for t in data["tensors"]))


def _architecture(reader: gguf.GGUFReader, path: Path) -> str:
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture key; not a model GGUF file")
    return str(field.contents())


def read_index(path: str | os.PathLike) -> GGUFIndex:
    """Parse the GGUF header at `path` (slow: seconds for a large vocabulary)."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error
    entries = tuple(
        TensorEntry(
            name=t.name,
            qtype=gguf.GGMLQuantizationType(int(t.tensor_type)),
            shape=tuple(int(d) for d in reversed(t.shape.tolist())),
            offset=int(t.data_offset),
            nbytes=int(t.n_bytes),
        )
        for t in reader.tensors
    )
    return GGUFIndex(_architecture(reader, path), entries)
