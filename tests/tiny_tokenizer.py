"""A tiny word-level tokenizer over the 96-token vocabulary of the tiny test models."""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ri", "so", "tu", "vé", "zo", "日"]


def words(count: int = 96 - len(SPECIALS)) -> list[str]:
    """Distinct words of one or two syllables (some non-ASCII), `count` of them."""
    out = list(SYLLABLES)
    for a in SYLLABLES:
        for b in SYLLABLES:
            if len(out) == count:
                return out
            out.append(a + b)
    return out


def save_tiny_tokenizer(folder: Path) -> Path:
    """Writes a tokenizer (ids 0-3 special, 4-95 words; bos 1, eos 2) into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(str(folder))
    return folder
