"""OpenMP thread settings for a process that runs the model; applied before torch loads.

torch's OpenMP threads wait at every barrier between ops. Spinning for long (libgomp's default
300k spins) made decode steps ~10x slower on 2 cores whenever another process wanted a core;
never spinning (PASSIVE) costs a thread wake-up per parallel op, which made a mixed
prefill+decode workload 30% slower on a quiet machine (19.1 vs 14.7 s). A short spin (10k) keeps
that speed and stays within 1.4x of PASSIVE with two torch processes sharing 2 cores.

`stemma.engine` applies these on import (the engine process, `stemma generate` and an in-process
`stemma.Engine` all load it before torch); `import stemma` alone changes nothing. They take effect
only if torch is not imported yet. Set either variable to choose otherwise.
"""
from __future__ import annotations

import os
import sys

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}  # spin 10k times, then sleep


def apply_defaults() -> bool:
    """Sets DEFAULTS unless the user set either variable or torch is loaded; True if it set them."""
    if "torch" in sys.modules or any(name in os.environ for name in DEFAULTS):
        return False
    os.environ.update(DEFAULTS)
    return True
