"""Guides, the batched bitmask, the Index cache, and jump-forward's boundary handling, on the
ByteLevel test tokenizer (all 256 byte tokens plus ~100 merges)."""
import ctypes

import pytest
import torch

from stemma.constrained import bitmask, jump_forward
from stemma.constrained.grammar import GrammarGuide, build_lltokenizer
from stemma.constrained.guide import RegexGuide
from stemma.constrained.index_cache import IndexCache
from stemma.constrained.vocab import build_vocab
from tests.bytelevel_tokenizer import save_bytelevel_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = save_bytelevel_tokenizer(tmp_path_factory.mktemp("bytelevel_guides"))
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture(scope="module")
def vocab(tok):
    return build_vocab(tok, len(tok) + 5)  # 365: not a multiple of 32


@pytest.fixture(scope="module")
def cache():
    return IndexCache(capacity=8)


def encoder(tok):
    return lambda text: tok.encode(text, add_special_tokens=False)


def one(tok, piece: str) -> int:
    ids = tok.encode(piece, add_special_tokens=False)
    assert len(ids) == 1, (piece, tok.convert_ids_to_tokens(ids))
    return ids[0]


def byte(vocab, char: str) -> int:
    return vocab.byte_token_ids[ord(char)]


def allowed_ids(mask_row: torch.Tensor, size: int) -> list[int]:
    return bitmask.allowed(mask_row[None], size)[0].nonzero().flatten().tolist()


# ---------------------------------------------------------------- bitmask


class FakeGuide:
    def __init__(self, words: torch.Tensor, final: bool):
        self.words, self.final = words, final

    def fill_mask(self, address, words):  # writes its row into the bitmask's memory, as guides do
        ctypes.memmove(address, self.words.data_ptr(), words * 4)

    def is_final(self):
        return self.final


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 2, 3], [4, 0, 2], [3]])
def test_fill_and_apply_mask_only_the_constrained_rows(rows):
    gen = torch.Generator().manual_seed(len(rows))
    size, batch = 100, 5
    words = bitmask.words_for(size)
    dense = torch.rand(len(rows), words * 32, generator=gen) < 0.3
    packed = (dense.view(len(rows), words, 32).int() << torch.arange(32)).sum(-1).to(torch.int32)
    guides = [FakeGuide(packed[i].contiguous(), final=bool(i % 2)) for i in range(len(rows))]
    mask = bitmask.fill(guides, size)
    assert torch.equal(mask, packed)
    ends = bitmask.EndTokens.of([7, 40, 9])  # two in word 0, one in word 1
    ends.set(mask, [g.is_final() for g in guides])
    logits = torch.randn(batch, size, generator=gen).to(torch.bfloat16)
    before = logits.clone()
    bitmask.apply(logits, mask, rows)
    for r in range(batch):
        if r not in rows:
            assert torch.equal(logits[r], before[r])  # untouched, bit for bit
            continue
        i = rows.index(r)
        keep = dense[i, :size].clone()
        keep[[7, 40, 9]] = guides[i].final
        assert torch.equal(logits[r], before[r].masked_fill(~keep, float("-inf")))


def test_end_token_bits_reach_bit_31():
    mask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask.EndTokens.of([31, 32]).set(mask, [True, False])
    assert allowed_ids(mask[0], 64) == [31, 32] and allowed_ids(mask[1], 64) == []


# ---------------------------------------------------------------- regex guides and the cache


def test_regex_guide_mask_follows_the_index(tok, vocab, cache):
    guide = RegexGuide(cache.get(r"(yes|no)!?", vocab), vocab)
    mask = bitmask.fill([guide], vocab.size)
    allowed = {vocab.token_bytes[i] for i in allowed_ids(mask[0], vocab.size)}
    assert b"y" in allowed and b"n" in allowed and b"yes" in allowed and b"x" not in allowed
    assert not guide.is_final() and not guide.is_terminated()
    assert guide.accept(one(tok, "yes"))
    assert guide.is_final() and not guide.is_terminated()  # "!" may still follow
    assert not guide.accept(byte(vocab, "n")) and "No next state" in guide.error
    guide = RegexGuide(cache.get(r"(yes|no)!?", vocab), vocab)
    assert guide.accept_many([byte(vocab, c) for c in "no!?"]) == 3  # stops at the refused "?"
    assert guide.is_terminated()


def test_a_regex_guide_goes_on_where_its_regex_may_end(tok, vocab, cache):
    """outlines-core's own Index drops the ways on from a state where the regex may end: `a|abc`
    never wrote `abc`, and a number refused `.` after `0`. The marked Index keeps them."""
    ends = cache.get("a|abc", vocab)
    assert ends.end == vocab.eos_token_id  # marked
    guide = RegexGuide(ends, vocab)
    assert guide.accept(byte(vocab, "a")) and guide.is_final() and not guide.is_terminated()
    allowed = {vocab.token_bytes[i] for i in allowed_ids(bitmask.fill([guide], vocab.size)[0], vocab.size)}
    assert b"b" in allowed and b"a" not in allowed
    assert guide.accept(byte(vocab, "b")) and not guide.is_final()
    assert guide.accept(byte(vocab, "c")) and guide.is_terminated()
    number = RegexGuide(cache.get(r"(-)?(0|[1-9][0-9]*)(\.[0-9]+)?", vocab), vocab)
    assert number.accept(byte(vocab, "0")) and number.is_final() and not number.is_terminated()
    assert number.accept(byte(vocab, ".")) and not number.is_final()
    assert number.accept(byte(vocab, "5")) and number.is_final()
    # a NUL, the mark, is never written; a regex that could reach a state from which every way
    # to an end writes one gets the plain Index (marked, its guide could never end there)
    anything = RegexGuide(cache.get(r"[\x00-\x7f]{2}", vocab), vocab)
    assert not anything.accept(byte(vocab, "\x00")) and anything.error
    for regex, text in ((r"a\x00", "a\x00"), (r"a+\x00", "aa\x00"), (r"b|a+\x00", "aa\x00")):
        plain = cache.get(regex, vocab)
        assert plain.end is None, regex
        guide = RegexGuide(plain, vocab)
        assert guide.accept_many([byte(vocab, c) for c in text]) == len(text) and guide.is_terminated()


def test_index_cache_keys_by_pattern_and_vocabulary(tok, vocab):
    cache = IndexCache(capacity=2)
    first = cache.get(r"\d+", vocab)
    assert cache.get(r"\d+", vocab) is first and cache.builds == 1
    narrower = build_vocab(tok, len(tok))
    assert cache.get(r"\d+", narrower) is not first and cache.builds == 2
    cache.get(r"[a-z]+", vocab)  # a third entry evicts the least recently used
    assert len(cache) == 2 and cache.lookup(r"\d+", vocab.fingerprint) is None
    assert cache.lookup(r"[a-z]+", vocab.fingerprint) is not None


# ---------------------------------------------------------------- jump-forward


def test_jump_forward_retokenizes_the_start_and_holds_back_the_end(tok, vocab, cache):
    guide = RegexGuide(cache.get(r'\{"name": "[a-z]+"\}', vocab), vocab)
    brace = one(tok, "{")
    assert guide.accept(brace)
    assert guide.forced_bytes(128) == b'"name": "'
    ids = jump_forward.plan(guide, brace, vocab, encoder(tok))
    # `{` + `"name": "` is written as the tokenizer would: `{"` `name` `":` (` "` is held back)
    assert tok.convert_ids_to_tokens(ids) == ['{"', "name", '":']
    assert ids[0] != brace
    assert guide.forced_bytes(128) == b' "'  # the guide stands right after the kept tokens
    assert guide.accept(one(tok, ' "'))


def test_jump_forward_to_the_end_keeps_every_token(tok, vocab, cache):
    guide = RegexGuide(cache.get("(yes|no)", vocab), vocab)
    y = byte(vocab, "y")
    assert guide.accept(y)
    ids = jump_forward.plan(guide, y, vocab, encoder(tok))
    assert ids == [one(tok, "yes")] and guide.is_terminated()


def test_jump_forward_without_gain_leaves_the_guide_as_it_was(tok, vocab, cache):
    guide = RegexGuide(cache.get("qz[xv]", vocab), vocab)
    q = byte(vocab, "q")
    assert guide.accept(q)
    assert jump_forward.plan(guide, q, vocab, encoder(tok)) is None  # `q` `z`: z is held back
    assert guide.forced_bytes(128) == b"z" and guide.accept(byte(vocab, "z"))


def test_jump_forward_refuses_a_tokenization_that_does_not_spell_the_bytes(tok, vocab, cache):
    guide = RegexGuide(cache.get('ab: "[0-9]"', vocab), vocab)
    a = byte(vocab, "a")
    assert guide.accept(a)
    prefix_space = lambda text: encoder(tok)(" " + text)  # noqa: E731 (a SentencePiece-like dummy prefix)
    assert jump_forward.plan(guide, a, vocab, prefix_space) is None
    assert guide.forced_bytes(128) == b'b: "'


def test_jump_forward_stops_at_a_partial_utf8_character(tok, vocab, cache):
    guide = RegexGuide(cache.get("x(\u00e9|\u00e8)", vocab), vocab)  # both start with byte 0xC3
    x = byte(vocab, "x")
    assert guide.accept(x)
    assert guide.forced_bytes(128) == b"\xc3"
    assert jump_forward.plan(guide, x, vocab, encoder(tok)) is None


def test_grammar_guide_jumps_forward_like_a_regex_guide(tok, vocab):
    lltok = build_lltokenizer(vocab, encoder(tok), bos_token_id=None)
    guide = GrammarGuide(lltok, 'start: "{\\"name\\": \\"" /[a-z]+/ "\\"}"')
    brace = one(tok, "{")
    assert guide.accept(brace)
    ids = jump_forward.plan(guide, brace, vocab, encoder(tok))
    assert tok.convert_ids_to_tokens(ids) == ['{"', "name", '":']
    mask = bitmask.fill([guide], vocab.size)
    allowed = {vocab.token_bytes[i] for i in allowed_ids(mask[0], vocab.size)}
    assert b' "' in allowed and b"x" not in allowed and vocab.end_ids[0] not in allowed_ids(mask[0], vocab.size)
    assert guide.accept_many(encoder(tok)(' "abc"}')) == len(encoder(tok)(' "abc"}'))
    assert guide.is_final() and guide.is_terminated()
