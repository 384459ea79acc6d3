"""benchmarks/latency.py's --stemma-options: each value as its EngineConfig field takes it."""
import importlib
import sys
from pathlib import Path

import pytest


def _benchmark(name: str):
    """Imports benchmarks/<name>.py with sys.path as it was afterwards: the benchmarks' folder
    (which the scripts put first) must not shadow installed packages for the rest of the
    session (its kernels.py shadowed the `kernels` package that transformers imports)."""
    saved = list(sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


parse_options = _benchmark("latency").parse_options


def test_a_text_field_keeps_its_text_and_other_fields_take_literals():
    # speculative=none is the README's way to measure the plain decode: "none" is the text,
    # not Python's None (which EngineConfig rejects)
    assert parse_options(["speculative=none", "kv_pool_tokens=32768", "enable_radix_cache=false"]) == {
        "speculative": "none", "kv_pool_tokens": 32768, "enable_radix_cache": False}


def test_an_unknown_field_fails_before_anything_starts():
    with pytest.raises(ValueError, match="no_such_field"):
        parse_options(["no_such_field=1"])


def test_an_event_of_several_tokens_is_one_gap_and_batch64_sweeps_llama_cpp_s_slots():
    """A verify step's k tokens come in one event: one wait for the reader, not one wait and
    k - 1 zero gaps (which pulled a speculating side's percentiles down); batch64 is compared
    with llama.cpp's best -np of those measured (issue 12), not with -np 16 alone."""
    latency = _benchmark("latency")
    trace = latency.Trace(sent=0.0)
    for now, total in ((1.0, 1), (1.5, 4), (1.6, 5)):
        trace.add(now, total)
    assert trace.gaps() == pytest.approx([0.5, 0.1])
    assert latency.parse_args([]).batch_parallel == [16, 32, 64]
