"""A test hook: faults injected into a running engine, so that tests (in a server subprocess too)
can prove that a fault fails one request, or one step's requests, and nothing else.

Read once, at import, from the environment variable STEMMA_INJECT_FAULTS: a comma-separated list
of `site:target`, where `site` is where the fault fires and `target` which requests it hits:

    postprocess:salt=<salt>   booking the sampled token of a request whose cache salt is <salt>
                              raises (the fault of one request's post-processing)
    forward:salt=<salt>       the forward of a step that runs a request with that salt raises (a
                              fault not tied to one request: every request of the step fails)
    forward:once              the next forward raises, once

Unset (always, outside tests), `INJECTED` is None and each site costs one `is not None` check.
An injected fault raises `InjectedFault`, a RuntimeError like any other bug would be.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from stemma.engine.request import Request

ENV = "STEMMA_INJECT_FAULTS"
SITES = ("postprocess", "forward")


class InjectedFault(RuntimeError):
    pass


@dataclass
class Faults:
    """The injected faults: site -> salts that trigger it; `once`: sites that fire on the next
    call whatever it runs, a single time."""
    salts: dict[str, frozenset[str]] = field(default_factory=dict)
    once: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, text: str) -> "Faults":
        faults = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            site, _, target = item.partition(":")
            if site not in SITES:
                raise ValueError(f"{ENV}: unknown site {site!r} in {item!r}; sites: {', '.join(SITES)}")
            if target == "once":
                faults.once.add(site)
            elif target.startswith("salt=") and len(target) > len("salt="):
                faults.salts[site] = faults.salts.get(site, frozenset()) | {target[len("salt="):]}
            else:
                raise ValueError(f"{ENV}: {item!r} must be {site}:once or {site}:salt=<salt>")
        return faults

    def fire(self, site: str, reqs: Sequence[Request]) -> None:
        """Raises InjectedFault when `site` is armed for one of `reqs` (or once)."""
        if site in self.once:
            self.once.discard(site)
            raise InjectedFault(f"injected {site} fault")
        salts = self.salts.get(site)
        if salts and any(r.salt in salts for r in reqs):
            raise InjectedFault(f"injected {site} fault")


def _from_env() -> Faults | None:
    text = os.environ.get(ENV)
    return Faults.parse(text) if text else None


INJECTED: Faults | None = _from_env()
