"""Counter-based random noise: a pure function of (seed, step, token id).

A seeded request must draw the same tokens whatever batch it lands in and whatever its row. A
stateful generator can't give that, since the draws of one row depend on how many its neighbours
took. Here the uniform number of token t at step s of a request with seed k is a hash of
(k, s, t), computed for many rows at once with int64 tensor ops:

    row key  = mix(mix(mix(k_lo ^ C) ^ k_hi) ^ s)        one per row           [S]
    bits     = mix(row key ^ mix(t ^ C))                  one per (row, token)  [S, V]
    uniform  = (bits + 0.5) / 2**32                       in (0, 1), never 0 or 1

`mix` is a 32-bit integer finalizer (the "lowbias32" constants published by C. Wellons): a
bijection on [0, 2**32) with strong avalanche. Every value stays below 2**32 and every product
below 2**49, so int64 never overflows on any device (`_mul32` splits the multiplier in halves).
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # separates the seed and token domains; any odd 32-bit constant does


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) (an int64 tensor or an int), without overflow."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def mix32(x):
    """A bijective 32-bit hash of values in [0, 2**32): an int64 tensor, elementwise, or an int."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[S] int64 keys from seeds in [0, 2**63) and steps in [0, 2**32)."""
    key = mix32((seeds & _MASK32) ^ _GOLDEN)
    key = mix32(key ^ (seeds >> 32))
    return mix32(key ^ (steps & _MASK32))


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, vocab_size] float64 uniforms in (0, 1), one per (row, token id)."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = mix32(row_keys(seeds, steps)[:, None] ^ mix32(tokens ^ _GOLDEN)[None, :])
    return (bits.to(torch.float64) + 0.5) * 2.0**-32


def seeded_gumbel(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, vocab_size] float32 standard Gumbel noise; argmax(logits + noise) samples softmax."""
    return (-torch.log(-torch.log(seeded_uniform(seeds, steps, vocab_size)))).float()


def sibling_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request with n > 1; index 0 keeps `seed` itself.

    Siblings sharing one seed would draw identical tokens; seed + index would collide with the
    request whose seed is one higher. A hash of (seed, index) does neither, in [0, 2**63).
    """
    if index == 0:
        return seed
    low = mix32(mix32((seed & _MASK32) ^ _GOLDEN) ^ (index & _MASK32))
    high = mix32(mix32((seed >> 32) ^ low) ^ (index >> 32))
    return ((high & 0x7FFFFFFF) << 32) | low
