"""The vocabulary builder: token id -> bytes on the real Gemma tokenizer (SentencePiece-style with
byte fallback) and on a GPT-2-style ByteLevel tokenizer built here."""
import pytest

from stemma.constrained.vocab import build_vocab, gpt2_byte_decoder
from tests.bytelevel_tokenizer import EOS, save_bytelevel_tokenizer
from tests.tiny_tokenizer import save_tiny_tokenizer

TEXTS = ["Hello world", "  two  spaces and\ttabs\n\nnewlines", '{"name": "Ada", "age": 36}',
         "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600", " leading space", "x\u00a0y\u2028z"]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from stemma.loader.gguf.loader import default_model_path
    from stemma.text.tokenizer import load_tokenizer
    return load_tokenizer(str(default_model_path()))


@pytest.fixture(scope="module")
def gemma(gemma_tokenizer):
    return build_vocab(gemma_tokenizer, 262144, eos_token_ids=(1,))


@pytest.fixture(scope="module")
def bytelevel(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = save_bytelevel_tokenizer(tmp_path_factory.mktemp("bytelevel"))
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tok, build_vocab(tok, len(tok) + 8)  # logits wider than the tokenizer


def test_gemma_bytes_fallback_space_and_added_tokens(gemma, gemma_tokenizer):
    ids = gemma_tokenizer.convert_tokens_to_ids(["<0x41>", "<0x0A>", "<0xFF>", "▁hello", "▁▁"])
    assert [gemma.token_bytes[i] for i in ids] == [b"A", b"\n", b"\xff", b" hello", b"  "]
    assert gemma.token_bytes[107] == b"\n" and gemma.token_bytes[108] == b"\n\n"  # added, not special
    assert gemma.byte_token_ids is not None and len(gemma.byte_token_ids) == 256


def test_gemma_specials_and_ends_are_no_text(gemma):
    assert gemma.eos_token_id == 1
    assert gemma.end_ids == (1, 106)  # <eos>, then <end_of_turn>
    for token_id in (0, 1, 2, 3, 105, 106, 262143):  # pad eos bos unk <start_of_turn> <end_of_turn> <unused>
        assert gemma.token_bytes[token_id] is None
    assert gemma.special[2] == "<bos>" and gemma.special[106] == "<end_of_turn>"
    assert all(b"<bos>" not in piece for piece in gemma.text_map())
    assert sum(piece is None for piece in gemma.token_bytes) == len(gemma.special)


@pytest.mark.parametrize("text", TEXTS)
def test_gemma_round_trip_is_exact(gemma, gemma_tokenizer, text):
    ids = gemma_tokenizer.encode(text, add_special_tokens=False)
    assert gemma.decode(ids) == text.encode("utf-8")  # single spaces stay single


@pytest.mark.parametrize("text", TEXTS)
def test_bytelevel_round_trip_is_exact(bytelevel, text):
    tok, vocab = bytelevel
    ids = tok.encode(text, add_special_tokens=False)
    assert vocab.decode(ids) == text.encode("utf-8")


def test_bytelevel_table_and_specials(bytelevel):
    tok, vocab = bytelevel
    table = gpt2_byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["A"] == 0x41
    eos = tok.convert_tokens_to_ids(EOS)
    assert vocab.eos_token_id == eos and vocab.token_bytes[eos] is None
    assert vocab.size == len(tok) + 8 and vocab.token_bytes[-8:] == (None,) * 8
    assert vocab.byte_token_ids is not None
    assert [vocab.token_bytes[i] for i in vocab.byte_token_ids] == [bytes([b]) for b in range(256)]


def test_fingerprint_tells_vocabularies_apart(gemma, bytelevel):
    assert gemma.fingerprint != bytelevel[1].fingerprint
    assert len(gemma.fingerprint) == 64


def test_wordpiece_decoder_is_refused_by_name(tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(save_tiny_tokenizer(tmp_path)), local_files_only=True)
    with pytest.raises(ValueError, match="WordPiece"):
        build_vocab(tok, 96)


SPLIT = "\U00013000\U00013001 \U0001F600 caf\u00e9"  # hieroglyphs and an emoji: a token a byte each


@pytest.mark.parametrize("which", ["gemma", "bytelevel"])
def test_token_bytes_join_up_where_single_tokens_decode_to_replacement_chars(which, gemma_tokenizer, bytelevel):
    """What a chat logprobs entry's `bytes` holds (stemma.serve.http): the token's own bytes, which
    join back into the text; decoded alone, a piece of a character is U+FFFD."""
    from stemma.text.token_bytes import TokenBytes
    tok = gemma_tokenizer if which == "gemma" else bytelevel[0]
    ids = tok.encode(SPLIT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case the bytes are for
    token_bytes = TokenBytes(tok)
    assert b"".join(token_bytes(i) for i in ids) == SPLIT.encode("utf-8")
    special = tok.eos_token_id
    assert token_bytes(special) == tok.decode([special]).encode()  # no byte form: its text


def test_token_bytes_fall_back_to_text_under_a_decoder_without_byte_form(tmp_path):
    from transformers import AutoTokenizer

    from stemma.text.token_bytes import TokenBytes
    tok = AutoTokenizer.from_pretrained(str(save_tiny_tokenizer(tmp_path)), local_files_only=True)
    token_bytes = TokenBytes(tok)
    assert token_bytes.scheme is None
    assert [token_bytes(i) for i in range(10)] == [tok.decode([i]).encode() for i in range(10)]
