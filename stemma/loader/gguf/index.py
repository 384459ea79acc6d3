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


INDEX_FORMAT = 2  # 2: the rope scaling keys (an entry of another format is read again)


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str
    tensors: tuple[TensorEntry, ...]
    # `{arch}.rope.scaling.type` and its factor (or the older `rope.scale_linear`), which
    # transformers' GGUF config leaves out; None where the file has none
    rope_scaling: tuple[str, float] | None = None

    def to_json(self) -> str:
        return json.dumps({"format": INDEX_FORMAT, "architecture": self.architecture,
                           "rope_scaling": list(self.rope_scaling) if self.rope_scaling else None,
                           "tensors": [t.to_json() for t in self.tensors]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "GGUFIndex":
        """Raises ValueError for an index of another format."""
        data = json.loads(text)
        if data.get("format") != INDEX_FORMAT:
            raise ValueError(f"a GGUF index of format {data.get('format')!r}, not {INDEX_FORMAT}")
        scaling = data["rope_scaling"]
        return cls(data["architecture"], tuple(TensorEntry.from_json(t) for t in data["tensors"]),
                   (str(scaling[0]), float(scaling[1])) if scaling else None)


def _architecture(reader: gguf.GGUFReader, path: Path) -> str:
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture key; not a model GGUF file")
    return str(field.contents())


def _scalar(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _rope_scaling(reader: gguf.GGUFReader, architecture: str) -> tuple[str, float] | None:
    kind = _scalar(reader, f"{architecture}.rope.scaling.type")
    factor = _scalar(reader, f"{architecture}.rope.scaling.factor")
    if factor is None:
        factor = _scalar(reader, f"{architecture}.rope.scale_linear")
        kind = kind or ("linear" if factor is not None else None)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    return str(kind), float(factor if factor is not None else 1.0)


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
    architecture = _architecture(reader, path)
    return GGUFIndex(architecture, entries, _rope_scaling(reader, architecture))
