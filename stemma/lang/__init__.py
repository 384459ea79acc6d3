"""The frontend language: programs of several model calls that share their prefixes.

Torch-free on import; the Engine backend imports the engine only when it is made.
"""
from stemma.lang.backends.base import TokenUsage
from stemma.lang.context import as_backend, get_backend, global_config, set_default_backend
from stemma.lang.errors import (BackendUnreachable, GenerationFailed, ProgramError, RoleError,
                                StmSyntaxError, UnknownVariable, VariableNotGenerated)
from stemma.lang.function import BatchResult, Function, function
from stemma.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from stemma.lang.primitives import (assistant, assistant_begin, assistant_end, gen, gen_int,
                                    gen_string, greedy_token_selection, image, select, system,
                                    system_begin, system_end, token_length_normalized,
                                    unconditional_likelihood_normalized, user, user_begin, user_end,
                                    video)
from stemma.lang.scoring import SelectResult
from stemma.lang.state import ForkGroup, ProgramState
from stemma.lang.stm import TextFunction, compile_text, load
from stemma.lang.tool import tool
from stemma.lang.usage import Usage


def fork(state: ProgramState, n: int = 1) -> ForkGroup:
    """`state.fork(n)`."""
    return state.fork(n)


__all__ = ["BackendUnreachable", "BatchResult", "ForkGroup", "Function", "GenerationFailed", "ProgramError",
           "ProgramState", "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "RoleError",
           "SelectResult", "StmSyntaxError", "TextFunction", "TokenUsage", "UnknownVariable", "Usage",
           "VariableNotGenerated", "as_backend", "assistant", "assistant_begin", "assistant_end",
           "compile_text", "fork", "function", "gen", "gen_int", "gen_string", "get_backend",
           "global_config", "greedy_token_selection", "image", "load", "select",
           "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized", "tool",
           "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video"]
