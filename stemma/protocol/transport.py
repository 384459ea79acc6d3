"""Socket options both ends of a client connection share. Torch-free.

ZeroMQ heartbeats turn a silent peer (a vanished host, a hung network) into a DISCONNECTED event
on the side that still listens: a client sees the server go, a server sees a client go.
"""
from __future__ import annotations

HEARTBEAT_IVL_MS = 1000      # how often each end pings the other
HEARTBEAT_TIMEOUT_MS = 5000  # how long an end waits for traffic before it drops the connection
