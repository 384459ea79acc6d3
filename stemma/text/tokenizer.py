"""The tokenizer of a model, without loading its weights: for the gateway process, the frontend's
remote backend and the loader. Torch-free; the only module of the torch-free layers that imports
transformers (its tokenizers only).

A GGUF file's tokenizer comes from its metadata cache entry (see stemma.paths), which the engine
has built by the time it reports ready. Without an entry, transformers reads the tokenizer from
the GGUF file itself (slower; the entry is written by the next model load).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stemma.paths import GGUF_INDEX_FILE, gguf_entry_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def preload_tokenizers() -> None:
    """Imports transformers' tokenizer classes (seconds), so a later load_tokenizer is quick."""
    from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The transformers tokenizer of the GGUF file or Hugging Face folder at `path`, or None when a
    folder has no tokenizer files."""
    from transformers import AutoTokenizer
    source = Path(path)
    if source.is_file() and source.suffix == ".gguf":
        entry = gguf_entry_dir(source)
        if (entry / GGUF_INDEX_FILE).is_file():
            return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name,
                                             local_files_only=True)
    if not any((source / name).exists() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(source), local_files_only=True)


def encode_prompt(tokenizer: PreTrainedTokenizerBase | None, text: str, what: str = "prompt") -> list[int]:
    """`text`'s token ids (special tokens added, as the model expects a prompt); a ValueError,
    naming `what`, when there is no tokenizer or no token."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; send token ids instead of text")
    ids = list(tokenizer(text).input_ids)
    if not ids:
        raise ValueError(f"{what} must hold at least one token")
    return ids
