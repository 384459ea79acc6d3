"""SGLang's role methods, shared by the running state (ProgramState) and the tracing one
(TracingState): `s.user(text)` appends a whole turn, `with s.user(): ...` wraps what the block
appends in one. They only append constant nodes, so the tracer follows them as it follows `+=`."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from stemma.lang.ir import Concat, Content, RoleBegin, RoleEnd, as_node


class RoleMethods:
    """For a class whose `+=` appends a node and returns the state itself."""

    def system(self, content: Content | None = None):
        """`s.system(text)` appends a system turn; `with s.system(): ...` wraps what the block
        appends in one."""
        return self._role("system", content)

    def user(self, content: Content | None = None):
        return self._role("user", content)

    def assistant(self, content: Content | None = None):
        return self._role("assistant", content)

    def _role(self, role: str, content: Content | None):
        if content is None:
            return self._role_scope(role)
        self += Concat((RoleBegin(role), as_node(content), RoleEnd(role)))
        return None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        state = self
        state += RoleBegin(role)
        yield
        state += RoleEnd(role)
