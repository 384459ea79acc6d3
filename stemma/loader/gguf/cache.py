"""The on-disk cache that makes a GGUF model load fast after the first time.

Parsing a GGUF header (the vocabulary above all) costs seconds, and transformers parses it again
for the config and again for the tokenizer. So the first load of a file (cold) does all of that
once and saves the results; later loads (warm) read them back:

    <root>/gguf/<file stem>-<key>/
        config.json                  AutoConfig.save_pretrained
        tokenizer.json, tokenizer_config.json, ...   AutoTokenizer.save_pretrained
        index.json                   GGUFIndex: tensor name, type, shape, byte range

`<root>` and `<key>` are stemma.paths' (torch-free, so the gateway can find the tokenizer).
An entry is written into a hidden temporary sibling and renamed into place, so readers only ever
see whole entries; a crash mid-write leaves at most that hidden sibling behind.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from stemma.loader.gguf import config as gguf_config
from stemma.loader.gguf.index import GGUFIndex, read_index
from stemma.loader.gguf.names import check_architecture
from stemma.paths import GGUF_INDEX_FILE, gguf_entry_dir
from stemma.progress import stage

INDEX_FILE = GGUF_INDEX_FILE
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedMetadata:
    """Everything but the weights: the HF config and tokenizer, and where each tensor lies."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    index: GGUFIndex


def entry_dir(path: Path) -> Path:
    """The cache directory for the GGUF file at `path` (which must exist); see stemma.paths."""
    return gguf_entry_dir(path)


def _write_entry(path: Path, target: Path) -> None:
    """Cold path: parse the file three ways and publish the results at `target` atomically."""
    stage(logger, "first load of %s: reading its tensor index (once; the config, tokenizer and "
          "index are cached under %s)", path.name, target.parent)
    index = read_index(path)
    check_architecture(index.architecture)
    source = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name,
              "local_files_only": True}
    stage(logger, "first load of %s: parsing its config from the GGUF header", path.name)
    config = AutoConfig.from_pretrained(**source)
    stage(logger, "first load of %s: parsing its tokenizer from the GGUF header (the slowest "
          "step, tens of seconds)", path.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / INDEX_FILE).write_text(index.to_json())
        try:
            staging.rename(target)
        except OSError:
            if not (target / INDEX_FILE).is_file():  # not a concurrent writer finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _cached_index(target: Path) -> GGUFIndex | None:
    """The entry's index, or None when the entry is not whole or of an older format."""
    try:
        return GGUFIndex.from_json((target / INDEX_FILE).read_text())
    except (OSError, ValueError, KeyError):
        return None


def _discard(target: Path) -> None:
    """Removes an entry not written by us (entries appear whole) or of an older format. Another
    process may be doing the same (a tensor-parallel rank, a replica): one that finds the entry
    whole again by now keeps it, and one that finds it gone has nothing to do."""
    if not target.exists() or _cached_index(target) is not None:
        return
    aside = target.with_name(f"{target.name}.stale.{os.getpid()}")
    try:
        target.rename(aside)
    except FileNotFoundError:  # taken aside by another process first
        return
    shutil.rmtree(aside, ignore_errors=True)


def load_metadata(path: Path) -> CachedMetadata:
    """Config, tokenizer and tensor index for the GGUF file at `path`, building the entry if absent.
    The config has what transformers' leaves out put back (gguf.config)."""
    target = entry_dir(path)
    index = _cached_index(target)
    if index is None:
        _discard(target)
        index = _cached_index(target)  # another process may have written it meanwhile
    if index is None:
        _write_entry(path, target)
        index = GGUFIndex.from_json((target / INDEX_FILE).read_text())
    else:
        stage(logger, "reading the cached config, tokenizer and tensor index of %s", path.name)
    check_architecture(index.architecture)
    config = AutoConfig.from_pretrained(target, local_files_only=True)
    gguf_config.complete(config, index)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    return CachedMetadata(config, tokenizer, index)
