"""stemma: an LLM program runtime.

Heavy modules (torch, transformers) are imported lazily, on first use of a name that needs them.
"""
import os
from importlib import import_module

# torch's OpenMP threads spin at every barrier by default. When anything else wants a core (the
# gateway, a client, another process), each op then waits for a descheduled spinner: decode steps
# measured ~10x slower on 2 cores. Passive waiting costs little when the machine is quiet. Only
# effective if torch is not imported yet; set OMP_WAIT_POLICY=ACTIVE to opt out.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
    # the frontend language
    **{name: ("stemma.lang", name) for name in (
        "function", "gen", "select", "fork", "system", "user", "assistant", "system_begin",
        "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
        "set_default_backend", "ProgramState", "ProgramError", "VariableNotGenerated",
        "UnknownVariable", "StmSyntaxError", "BackendUnreachable", "Usage")},
    "load": ("stemma.lang", "load"),
    "compile_text": ("stemma.lang", "compile_text"),
    "MockBackend": ("stemma.lang.backends.mock", "MockBackend"),
    "EngineBackend": ("stemma.lang.backends.engine", "EngineBackend"),
    "RemoteBackend": ("stemma.lang.backends.remote", "RemoteBackend"),
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
