"""Where stemma keeps its on-disk caches. Torch-free: the gateway and the frontend find a GGUF
model's tokenizer here without loading the model.

    <root>/gguf/<file stem>-<key>/     the metadata cache entry of one GGUF file (loader.gguf.cache)

`<root>` is $STEMMA_CACHE_DIR, else ~/.cache/stemma. `<key>` hashes the file's resolved path,
size and modification time (and the entry format's version), so a rewritten file gets a fresh
entry.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

GGUF_ENTRY_FORMAT = 1
GGUF_INDEX_FILE = "index.json"  # written last into an entry: its presence means the entry is whole


def cache_root() -> Path:
    override = os.environ.get("STEMMA_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "stemma"


def gguf_entry_dir(path: Path) -> Path:
    """The cache directory for the GGUF file at `path` (which must exist)."""
    stat = path.stat()
    identity = f"v{GGUF_ENTRY_FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{key}"
