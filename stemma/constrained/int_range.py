"""A regex that matches exactly the JSON integers in [low, high] (either end may be open).

outlines-core writes every JSON integer as `-?(0|[1-9][0-9]*)` and ignores `minimum`/`maximum`, so
the bounds are spelled out here digit by digit: [a, b] splits by digit count, then each same-length
range splits at its first differing digit into a low tail, a run of free middle digits, and a high
tail. `-0` and leading zeros never match.
"""
from __future__ import annotations


def int_range_regex(low: int | None, high: int | None) -> str:
    if low is not None and high is not None and low > high:
        raise ValueError(f"empty integer range: minimum {low} > maximum {high}")
    parts = []
    if low is None or low < 0:  # the negatives, as '-' and their magnitudes
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        parts += ["-" + p for p in _naturals(bottom, top)]
    if high is None or high >= 0:
        parts += _naturals(max(low or 0, 0), high)
    return "(" + "|".join(parts) + ")"


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives matching the decimal numbers in [low, high] (high None: unbounded), low >= 0."""
    if high is not None and low > high:
        return []
    digits = len(str(low))
    top_digits = len(str(high)) if high is not None else digits
    out = []
    for n in range(digits, top_digits + 1):
        first = 10 ** (n - 1) if n > 1 else 0
        last = 10 ** n - 1
        out += _same_length(str(max(low, first)), str(last if high is None else min(high, last)))
    if high is None:  # every number with more digits than low
        out.append(f"[1-9][0-9]{{{digits},}}")
    return out


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives for the numbers between two digit strings of equal length, low <= high."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + p for p in _same_length(low[1:], high[1:])]
    rest = len(low) - 1
    out = []
    lo_digit, hi_digit = int(low[0]), int(high[0])
    if low[1:] == "0" * rest:
        lo_digit -= 1  # the low tail is full: the middle run takes it
    else:
        out += [low[0] + p for p in _same_length(low[1:], "9" * rest)]
    full_high = high[1:] == "9" * rest
    middle_top = hi_digit if full_high else hi_digit - 1
    if lo_digit + 1 <= middle_top:
        run = str(lo_digit + 1) if lo_digit + 1 == middle_top else f"[{lo_digit + 1}-{middle_top}]"
        out.append(f"{run}[0-9]{{{rest}}}")
    if not full_high:
        out += [high[0] + p for p in _same_length("0" * rest, high[1:])]
    return out
