"""Registries of named implementations whose names are known without importing them.

Each registry declares its names with the module that implements each one, so the parent process
(EngineConfig validation, `stemma --help`) knows every choice without importing torch. The
implementing module binds the object with `@REGISTRY.register(name)`; `get(name)` imports that
module on first use and returns what it registered.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Generic, Mapping, TypeVar

if TYPE_CHECKING:
    from stemma.attention.base import AttentionBackend
    from stemma.engine.policy import OrderFn
    from stemma.models.causal_lm import CausalLM

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str, declared: Mapping[str, str]):
        self.what = what                      # the option's name, used in error messages
        self._modules = dict(declared)        # name -> module that registers it
        self._entries: dict[str, T] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def unknown(self, name: object) -> ValueError:
        return ValueError(f"{self.what} must be one of {', '.join(self._modules)}, got {name!r}")

    def register(self, name: str) -> Callable[[T], T]:
        def bind(obj: T) -> T:
            module = getattr(obj, "__module__", None)
            if self._modules.get(name) != module:
                raise LookupError(f"{self.what} {name!r} is not declared for module {module}")
            if name in self._entries:
                raise LookupError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = obj
            return obj
        return bind

    def get(self, name: str) -> T:
        entry = self._entries.get(name)
        if entry is not None:
            return entry
        if name not in self._modules:
            raise self.unknown(name)
        importlib.import_module(self._modules[name])
        if name not in self._entries:
            raise LookupError(f"module {self._modules[name]} registers no {self.what} {name!r}")
        return self._entries[name]


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention_backend", {
    "torch": "stemma.attention.torch_backend",
    "triton": "stemma.attention.triton_backend",
})

POLICIES: Registry[OrderFn] = Registry("schedule_policy", {
    name: "stemma.engine.policy" for name in ("fcfs", "lpm", "dfs-weight", "sjf", "program")
})

MODEL_FAMILIES: Registry[type[CausalLM]] = Registry("model family", {
    "llama": "stemma.models.llama",
    "gemma3": "stemma.models.gemma3",
})
