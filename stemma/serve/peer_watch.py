"""Which clients of a ROUTER socket have disconnected.

ZeroMQ hides connections, but two of its facts line up: every received frame carries the file
descriptor of the connection it came over (`zmq.SRCFD`), and the socket monitor reports
DISCONNECTED with that same descriptor. So each client identity is mapped to the descriptor it
was last seen on, and a DISCONNECTED event names the identities that are gone. ZeroMQ heartbeats
on the ROUTER (see `configure`) turn a silent peer (a vanished host, a hung network) into a
DISCONNECTED event as well; a process that dies is seen at once, as its kernel closes the socket.

Descriptors are reused, so the monitor must be drained before the ROUTER is read: the disconnect
of an old connection is always queued before any frame of a new one on the same descriptor.
"""
from __future__ import annotations

import zmq
from zmq.utils.monitor import parse_monitor_message

from stemma.protocol.transport import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS


def configure(sock: zmq.Socket) -> None:
    """Sets ZeroMQ heartbeats, so that dead peers are disconnected (and reported) within seconds."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection `frame` came over, or -1 where ZeroMQ keeps none: it
    raises EINVAL for frames of a peer that spoke ZeroMQ's 1.0 wire format, which is how the
    bytes of an HTTP request sent to a ZeroMQ port parse."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return -1


class PeerWatch:
    def __init__(self, router: zmq.Socket):
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.fd_of: dict[bytes, int] = {}
        self.on_fd: dict[int, set[bytes]] = {}
        self.strangers: set[bytes] = set()  # peers that sent what is not stemma's protocol

    def first_strange(self, identity: bytes) -> bool:
        """True the first time `identity` sends a message that is not stemma's protocol (so that
        it is logged once, not once per message; the set is bounded, forgetting all at 1024)."""
        if identity in self.strangers:
            return False
        if len(self.strangers) >= 1024:
            self.strangers.clear()
        self.strangers.add(identity)
        return True

    def seen(self, identity: bytes, frame: zmq.Frame) -> None:
        """Records the connection a frame from `identity` came over (nothing when ZeroMQ does not
        know it: see source_fd)."""
        fd = source_fd(frame)
        if fd < 0 or self.fd_of.get(identity) == fd:
            return
        self._forget(identity)
        self.fd_of[identity] = fd
        self.on_fd.setdefault(fd, set()).add(identity)

    def gone(self) -> list[bytes]:
        """Identities whose connection has closed since the last call (does not block)."""
        out: list[bytes] = []
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for identity in self.on_fd.pop(event["value"], set()):
                    del self.fd_of[identity]
                    out.append(identity)
        return out

    def _forget(self, identity: bytes) -> None:
        fd = self.fd_of.pop(identity, None)
        if fd is not None:
            self.on_fd[fd].discard(identity)
            if not self.on_fd[fd]:
                del self.on_fd[fd]

    def close(self) -> None:
        self.monitor.close(linger=0)
