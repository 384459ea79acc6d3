"""The tokenizer of a model, without loading its weights (for the gateway process)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(path: str) -> Any:
    """The transformers tokenizer of the GGUF file or Hugging Face folder at `path`, or None when a
    folder has no tokenizer files. A GGUF file's tokenizer comes from its metadata cache entry,
    which the engine has built by the time it reports ready."""
    source = Path(path)
    if source.is_file() and source.suffix == ".gguf":
        from stemma.loader.gguf.cache import load_metadata
        return load_metadata(source).tokenizer
    if not any((source / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
