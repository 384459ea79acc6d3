"""Incremental detokenization on the real Gemma tokenizer (SentencePiece with byte fallback): the
same text however the ids come grouped (the engine pushes a token a step, the gateway a chunk or
a whole output), and stop strings held by min_new_tokens whatever the grouping."""
import pytest

from stemma.text.detokenizer import TextStream


@pytest.fixture(scope="module")
def tok():
    from stemma.loader.gguf.loader import default_model_path
    from stemma.text.tokenizer import load_tokenizer
    return load_tokenizer(str(default_model_path()))


def ids_of(tok, pieces):
    ids = tok.convert_tokens_to_ids(pieces)
    assert tok.unk_token_id not in ids, pieces
    return ids


def streamed(stream, ids, groups):
    out, at = "", 0
    for size in groups:
        out += stream.push(ids[at:at + size])
        at += size
    return out + stream.finish()


GROUPINGS = ([1] * 8, [8], [2, 6], [3, 1, 4])


@pytest.mark.parametrize("pieces, text", [
    # a character, then a byte the output ends in: byte fallback reads the run of four as four
    # U+FFFD, so the whole decode took back the finished "€" (one push) or gave three (a step each)
    (["▁a", "<0xE2>", "<0x82>", "<0xAC>", "<0xE4>"], " a€\ufffd"),
    (["<0xC3>", "<0xA9>", "<0xA9>", "▁ok"], "é\ufffd ok"),
])
def test_the_text_is_the_same_however_the_ids_come_grouped(tok, pieces, text):
    ids = ids_of(tok, pieces)
    for groups in GROUPINGS:
        groups = [g for g in groups if g][:len(ids)]
        groups[-1] += len(ids) - sum(groups)
        assert streamed(TextStream(tok), ids, groups) == text, groups


def test_a_stop_within_min_new_tokens_is_held_whatever_the_grouping(tok):
    """The held tokens' text waited on an incomplete character after it, and came out with the
    next push, when stops matched: a chunk stopped at "abc" where a token a step did not."""
    ids = ids_of(tok, ["abc", "<0xE2>", "<0x82>", "<0xAC>"])
    for groups in ([1, 1, 1, 1], [4], [2, 2], [3, 1]):
        stream = TextStream(tok, stops=["abc"], hold_stops=2)
        assert streamed(stream, ids, groups) == "abc€" and stream.stopped is None, groups
