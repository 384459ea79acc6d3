"""stemma: an LLM program runtime.

Heavy modules (torch, transformers) are imported lazily, on first use of a name that needs them.
"""
import os
from importlib import import_module

# torch's OpenMP threads wait at every barrier between ops. Spinning for long (libgomp's default
# 300k spins) made decode steps ~10x slower on 2 cores whenever another process wanted a core;
# never spinning (PASSIVE) costs a thread wake-up per parallel op, which made a mixed
# prefill+decode workload 30% slower on a quiet machine (19.1 vs 14.7 s). A short spin (10k) keeps
# that speed and stays within 1.4x of PASSIVE with two torch processes sharing 2 cores.
# Only effective if torch is not imported yet; set either variable to choose otherwise.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"   # spin GOMP_SPINCOUNT times, then sleep
    os.environ["GOMP_SPINCOUNT"] = "10000"

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
