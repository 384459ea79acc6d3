"""stemma: an LLM program runtime.

Heavy modules (torch, transformers) are imported lazily, on first use of a name that needs them.
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "SamplingParams": ("stemma.sampling_params", "SamplingParams"),
    "Engine": ("stemma.runtime.engine", "Engine"),
    "EngineConfig": ("stemma.runtime.engine_config", "EngineConfig"),
    "RequestOutput": ("stemma.runtime.outputs", "RequestOutput"),
    "connect": ("stemma.runtime.client", "connect"),
    "Client": ("stemma.runtime.client", "Client"),
    "ServerError": ("stemma.runtime.client_base", "ServerError"),
    "Runtime": ("stemma.runtime.local_runtime", "Runtime"),
}


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stemma' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
