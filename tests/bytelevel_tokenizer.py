"""A small GPT-2-style ByteLevel BPE tokenizer, trained in the test on a few lines of JSON-ish text
(all 256 bytes, ~100 merges, one special), and a tiny random llama sized to it. Nothing is
downloaded."""
from __future__ import annotations

from pathlib import Path

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"]}',
    '{"name": "Bob", "age": 7, "city": "Paris", "ok": true, "score": 12}',
    'The date is 2024-05-17 and the phone number is (555) 123-4567.',
    "1+2*(3-4)/5 yes no maybe hello world the quick brown fox jumps over the lazy dog",
    "caf\u00e9 na\u00efve \u65e5\u672c \U0001F600 tab\tnewline\n",
] * 20
EOS = "<|endoftext|>"


def save_bytelevel_tokenizer(folder: Path, vocab_size: int = 360) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS)
    tok.save_pretrained(str(folder))
    return folder


def build_tiny_bytelevel(folder: Path, seed: int = 0) -> Path:
    """A tiny random llama whose vocabulary is the ByteLevel tokenizer's, saved with it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_models import tiny_config
    save_bytelevel_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(folder))
    return folder
