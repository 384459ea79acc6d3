"""`stemma tune`: the kernel dispatch table of a model on this machine (stemma.executor.tuning)."""
from __future__ import annotations

import sys
from typing import Any

from stemma.engine_config import EngineConfig


def run_tune(options: dict[str, Any], show_only: bool, all_stores: bool) -> int:
    """Loads the model as the engine would and prints its table: the cached one with `show_only`
    (measured if absent), else measured anew and cached."""
    from stemma.engine.engine import resolve_device
    from stemma.executor import tuning
    from stemma.loader.model import load_model
    config = EngineConfig.from_kwargs(**options)
    loaded = load_model(config.model, config.dtype, resolve_device(config.device), config.quantization,
                        config.int4_group_size)
    table = tuning.load_or_measure(loaded.model, tuning.model_dtype(loaded.model), all_stores=all_stores,
                                   remeasure=not show_only)
    sys.stdout.write(f"model {loaded.source}, quantization {config.quantization}: "
                     f"{sorted(set(loaded.stores.values()))} stores\n{table.show()}\n")
    return 0
