"""Which backend a program runs on: the one passed to run, else the context's default, else the
process's (the last one set anywhere: a thread pool's threads start with empty contexts, and in
SGLang the default is process-wide), else the embedded runtime on the default model (started on
first use)."""
from __future__ import annotations

import contextvars
import sys
from typing import TYPE_CHECKING, TypeAlias

from stemma.lang.backends.base import Backend

if TYPE_CHECKING:
    from stemma.client.sync import Client
    from stemma.engine.engine import Engine
    from stemma.serve.runtime import Runtime

BackendLike: TypeAlias = "Backend | Client | Runtime | Engine | str"  # what as_backend takes

_DEFAULT: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("stemma_backend", default=None)
_PROCESS_DEFAULT: list[Backend | None] = [None]  # where no context has one


def as_backend(value: BackendLike) -> Backend:
    """A Backend for: a Backend, a client (stemma.connect), a stemma.Runtime, a stemma.Engine, or
    a server address."""
    if isinstance(value, Backend):
        return value
    from stemma.lang.backends.remote import remote_backend_for
    backend = remote_backend_for(value)
    if backend is not None:
        return backend
    engine = sys.modules.get("stemma.engine.engine")
    if engine is not None and isinstance(value, engine.Engine):
        from stemma.lang.backends.engine import EngineBackend
        return EngineBackend(value)
    raise TypeError(f"a backend must be a stemma Backend, client, Runtime, Engine or address, "
                    f"got {type(value).__name__}")


def set_default_backend(value: BackendLike) -> Backend:
    """Makes `value` (see as_backend) the backend of programs run in this context from now on,
    and in contexts that have set none (other threads'), as SGLang's is."""
    backend = as_backend(value)
    _DEFAULT.set(backend)
    _PROCESS_DEFAULT[0] = backend
    return backend


def clear_default_backend() -> None:
    """Forgets every default set so far, this context's and the process's."""
    _DEFAULT.set(None)
    _PROCESS_DEFAULT[0] = None


def get_backend(value: BackendLike | None = None) -> Backend:
    if value is not None:
        return as_backend(value)
    backend = _DEFAULT.get() or _PROCESS_DEFAULT[0]
    if backend is None:
        from stemma.lang.backends.remote import embedded_default
        backend = embedded_default()
    return backend


class GlobalConfig:
    """SGLang's `sgl.global_config`: `default_backend` is the backend programs run on when none
    is passed (reading it without one set starts the embedded default, as a run would); setting
    it is set_default_backend. SGLang's other settings can be set and change nothing."""

    @property
    def default_backend(self) -> Backend:
        return get_backend()

    @default_backend.setter
    def default_backend(self, value: BackendLike) -> None:
        set_default_backend(value)


global_config = GlobalConfig()
