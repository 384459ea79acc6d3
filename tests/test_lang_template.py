"""Chat templates split into per-role prefixes and suffixes, the fallbacks, and how a program keeps
the token ids of generated text (codec.settle)."""
import pytest

from stemma.lang.chat_template import PLAIN, for_codec
from stemma.lang.codec import HFCodec
from stemma.lang.backends.mock import MockCodec
from tests.tiny_tokenizer import save_tiny_tokenizer

CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

GEMMA_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (first if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}")


@pytest.fixture
def tokenizer(tmp_path):
    from transformers import AutoTokenizer
    save_tiny_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                         "<start_of_turn>", "<end_of_turn>"]})
    return tok


def test_chatml_template(tokenizer):
    tokenizer.chat_template = CHATML
    template = for_codec(HFCodec(tokenizer))
    assert template.name == "tokenizer"
    for role in ("system", "user", "assistant"):  # the default system block is not repeated
        assert template.roles[role] == (f"<|im_start|>{role}\n", "<|im_end|>\n")
    assert template.stop_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_template_that_folds_system_into_the_first_turn(tokenizer):
    tokenizer.chat_template = GEMMA_LIKE
    template = for_codec(HFCodec(tokenizer))
    assert template.roles["user"] == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert template.roles["assistant"] == ("<start_of_turn>model\n", "<end_of_turn>\n")
    assert template.roles["system"] == template.roles["user"]
    assert template.stop_ids == (tokenizer.convert_tokens_to_ids("<end_of_turn>"),)


def test_fallback(tokenizer):
    assert for_codec(HFCodec(tokenizer)) is PLAIN  # no template, even with Gemma's turn tokens
    assert for_codec(MockCodec()) is PLAIN
    assert PLAIN.roles["user"] == ("User: ", "\n") and "\nUser:" in PLAIN.stop


def test_codec_start_ids(tokenizer):
    assert HFCodec(tokenizer).start_ids == ()  # the tiny tokenizer adds no BOS
    from tokenizers import processors
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    assert HFCodec(tokenizer).start_ids == (tokenizer.bos_token_id,)


@pytest.mark.parametrize("ids, text, trimmed, stop_ids, kept", [
    ("abc", "abc", False, (), "abc"),
    ("abc\x01", "abc", False, (), "abc"),            # EOS (a special id) is dropped
    ("abc|", "abc", False, (ord("|"),), "abc"),      # so is a stop token id
    ("ab\ncd", "ab", True, (), "ab"),                # ids past a stop string are dropped
    ("ab", "ab", True, (), "ab"),                    # stopped by EOS although stop strings were set
])
def test_settle(ids, text, trimmed, stop_ids, kept):
    codec = MockCodec()
    assert codec.settle([ord(c) for c in ids], text, trimmed, stop_ids) == [ord(c) for c in kept]


def test_settle_replaces_a_token_that_straddles_the_stop():
    class Pairs(MockCodec):  # one token per two characters
        def encode(self, text):
            return [sum(ord(c) << (16 * i) for i, c in enumerate(text[j:j + 2])) for j in range(0, len(text), 2)]

        def decode(self, ids):
            out = ""
            for t in ids:
                while t:
                    out, t = out + chr(t & 0xFFFF), t >> 16
            return out

    codec = Pairs()
    ids = codec.encode("abcdef")  # ab cd ef; the stop string "d" cut the text to "abc"
    assert codec.settle(ids, "abc", True) == codec.encode("ab") + codec.encode("c")
