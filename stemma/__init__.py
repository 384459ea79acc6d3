"""stemma: an LLM program runtime.

Heavy modules (torch, transformers) are imported lazily, on first use of a name that needs them.
Importing stemma changes no environment variable: the OpenMP settings are applied where a process
that runs the model starts (see stemma.engine.threads).
"""
from importlib import import_module as _import_module

__version__ = "0.1.0"

_LAZY = {
    "SamplingParams": ("stemma.sampling_params", "SamplingParams"),
    "ProgramCall": ("stemma.program_call", "ProgramCall"),
    "Engine": ("stemma.engine.engine", "Engine"),
    "EngineConfig": ("stemma.engine_config", "EngineConfig"),
    "RequestOutput": ("stemma.outputs", "RequestOutput"),
    "connect": ("stemma.client.sync", "connect"),
    "Client": ("stemma.client.sync", "Client"),
    "ServerError": ("stemma.client.core", "ServerError"),
    "RequestTimeout": ("stemma.client.core", "RequestTimeout"),
    "Unreachable": ("stemma.client.core", "Unreachable"),
    "Runtime": ("stemma.serve.runtime", "Runtime"),
    "RayPlacement": ("stemma.serve.ray_placement", "RayPlacement"),
    "Routing": ("stemma.serve.router", "Routing"),
    "Supervision": ("stemma.serve.supervisor", "Supervision"),
    # the frontend language (with SGLang's names: `import stemma as sgl`, docs/from-sglang.md)
    **{name: ("stemma.lang", name) for name in (
        "function", "gen", "select", "fork", "system", "user", "assistant", "system_begin",
        "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
        "set_default_backend", "ProgramState", "ProgramError", "VariableNotGenerated",
        "UnknownVariable", "StmSyntaxError", "BackendUnreachable", "GenerationFailed", "Usage", "TokenUsage",
        "gen_int", "gen_string", "image", "video", "global_config", "token_length_normalized",
        "greedy_token_selection", "unconditional_likelihood_normalized", "tool")},
    "load": ("stemma.lang", "load"),
    "compile_text": ("stemma.lang", "compile_text"),
    "MockBackend": ("stemma.lang.backends.mock", "MockBackend"),
    "EngineBackend": ("stemma.lang.backends.engine", "EngineBackend"),
    "RemoteBackend": ("stemma.lang.backends.remote", "RemoteBackend"),
    "RuntimeEndpoint": ("stemma.lang.backends.remote", "RuntimeEndpoint"),
    "OpenAIBackend": ("stemma.lang.backends.openai", "OpenAIBackend"),
    **{name: ("stemma.lang.backends.openai", name) for name in (
        "OpenAI", "Anthropic", "LiteLLM", "VertexAI")},
}


__all__ = sorted(_LAZY)  # `from stemma import *` (loads each, torch with the engine's)


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(_import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stemma' has no attribute {name!r}")


def __dir__():
    """The public names, each once: the lazy ones (loaded or not) and the module's dunders; not
    its private helpers, nor the submodules that loading a name has bound here."""
    return sorted(set(_LAZY) | {"__version__"} | {n for n in globals() if n.startswith("__")})
