"""benchmarks/latency.py's --stemma-options: each value as its EngineConfig field takes it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from latency import parse_options  # noqa: E402


def test_a_text_field_keeps_its_text_and_other_fields_take_literals():
    # speculative=none is the README's way to measure the plain decode: "none" is the text,
    # not Python's None (which EngineConfig rejects)
    assert parse_options(["speculative=none", "kv_pool_tokens=32768", "enable_radix_cache=false"]) == {
        "speculative": "none", "kv_pool_tokens": 32768, "enable_radix_cache": False}


def test_an_unknown_field_fails_before_anything_starts():
    with pytest.raises(ValueError, match="no_such_field"):
        parse_options(["no_such_field=1"])
