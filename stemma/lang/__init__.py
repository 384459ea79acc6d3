"""The frontend language: programs of several model calls that share their prefixes.

Torch-free on import; the Engine backend imports the engine only when it is made.
"""
from stemma.lang.context import as_backend, get_backend, set_default_backend
from stemma.lang.errors import (BackendUnreachable, ProgramError, RoleError, StmSyntaxError,
                                UnknownVariable, VariableNotGenerated)
from stemma.lang.function import BatchResult, Function, function
from stemma.lang.primitives import (assistant, assistant_begin, assistant_end, gen, select, system,
                                    system_begin, system_end, user, user_begin, user_end)
from stemma.lang.scoring import SelectResult
from stemma.lang.state import ForkGroup, ProgramState
from stemma.lang.stm import TextFunction, compile_text, load
from stemma.lang.usage import Usage


def fork(state: ProgramState, n: int) -> ForkGroup:
    """`state.fork(n)`."""
    return state.fork(n)


__all__ = ["BackendUnreachable", "BatchResult", "ForkGroup", "Function", "ProgramError",
           "ProgramState", "RoleError", "SelectResult", "StmSyntaxError", "TextFunction", "UnknownVariable", "Usage",
           "VariableNotGenerated", "as_backend", "assistant", "assistant_begin", "assistant_end",
           "compile_text", "fork", "function", "gen", "get_backend", "load", "select", "set_default_backend", "system",
           "system_begin", "system_end", "user", "user_begin", "user_end"]
