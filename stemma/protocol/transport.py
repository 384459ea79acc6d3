"""Socket options both ends of a client connection share. Torch-free.

ZeroMQ heartbeats turn a silent peer (a vanished host, a hung network) into a DISCONNECTED event
on the side that still listens: a client sees the server go, a server sees a client go.
"""
from __future__ import annotations

HEARTBEAT_IVL_MS = 1000      # how often each end pings the other
HEARTBEAT_TIMEOUT_MS = 5000  # how long an end waits for traffic before it drops the connection


def ipv6_literal(address: str) -> bool:
    """Whether a tcp:// address names its host as an IPv6 literal (tcp://[::1]:port): only then
    does a ZeroMQ socket take IPv6 (zmq.IPV6). With it set, libzmq resolves a host name to its
    IPv6 address first, so tcp://localhost would reach ::1 while the server listens on 127.0.0.1."""
    return address.startswith("tcp://[")
