"""Which clients of a ROUTER socket have disconnected.

ZeroMQ hides connections, but two of its facts line up: every received frame carries the file
descriptor of the connection it came over (`zmq.SRCFD`), and the socket monitor reports
DISCONNECTED with that same descriptor. So each client identity is mapped to the descriptor it
was last seen on, and a DISCONNECTED event names the identities that are gone. ZeroMQ heartbeats
on the ROUTER (see `configure`) turn a silent peer (a vanished host, a hung network) into a
DISCONNECTED event as well; a process that dies is seen at once, as its kernel closes the socket.

Descriptors are reused, and that is what makes the mapping unambiguous only with care:

    Invariant: when `seen` maps an identity to descriptor fd, no DISCONNECTED event of an older
    connection on fd is still unread in the monitor.

It holds because `seen` drains the monitor itself, right before it maps the identity, and because
ZeroMQ's I/O thread queues a connection's DISCONNECTED event before it closes the descriptor (the
engine reports the error, then is destroyed, which closes it): a new connection can only get the
same descriptor after that, and its frames come after its accept. So the DISCONNECTED event of
the old connection is already queued when the new connection's first frame is read, and draining
the monitor then consumes it, before the new identity is mapped. Any DISCONNECTED event for fd
read after the mapping is the new connection's own.

Draining once per burst of ROUTER frames is not enough: during a burst, an old connection on fd
may close and a new one take fd and send a request; that request would be mapped to fd, and the
old connection's event, read at the next drain, would drop the new client at once, aborting its
requests with no reply to it (a stream that never starts).

A frame of a connection that closed can still be read after its DISCONNECTED event (ZeroMQ
delivers what arrived before the close); its identity is then mapped to a descriptor no longer
its own. That client is gone anyway: replies to it fail with EHOSTUNREACH (the gateway drops it
then), and the stale entry goes with the next DISCONNECTED event on that descriptor.
"""
from __future__ import annotations

import uuid

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
        self.router = router
        # an address of its own: pyzmq's default derives it from the socket's descriptor, which
        # a closed socket's endpoint (not yet released) may still hold
        self.monitor = router.get_monitor_socket(
            zmq.EVENT_DISCONNECTED, addr=f"inproc://stemma-peer-watch-{uuid.uuid4().hex}")
        self.fd_of: dict[bytes, int] = {}
        self.on_fd: dict[int, set[bytes]] = {}
        self.strangers: set[bytes] = set()  # peers that sent what is not stemma's protocol
        self._gone: list[bytes] = []        # found gone by a drain, not yet handed out by `gone`
        self.disconnects = 0                # DISCONNECTED events read (for tests and debugging)

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
        """Records the connection a frame from `identity` (just received) came over; nothing when
        ZeroMQ does not know it (see source_fd). Drains the monitor first: see the invariant in
        the module's docstring. The caller should then take `gone()` before it acts on the frame,
        so that requests of clients found gone are aborted at once."""
        self._drain()
        fd = source_fd(frame)
        if fd < 0 or self.fd_of.get(identity) == fd:
            return
        self._forget(identity)
        self.fd_of[identity] = fd
        self.on_fd.setdefault(fd, set()).add(identity)

    def gone(self) -> list[bytes]:
        """Identities whose connection has closed since the last call (does not block)."""
        self._drain()
        out, self._gone = self._gone, []
        return out

    def _drain(self) -> None:
        """Reads every event the monitor holds, noting the identities each DISCONNECTED removes.
        (ZMQ_EVENTS processes the socket's pending commands, so it sees all that is queued.)"""
        while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                for identity in self.on_fd.pop(event["value"], set()):
                    del self.fd_of[identity]
                    self._gone.append(identity)

    def _forget(self, identity: bytes) -> None:
        fd = self.fd_of.pop(identity, None)
        if fd is not None:
            self.on_fd[fd].discard(identity)
            if not self.on_fd[fd]:
                del self.on_fd[fd]

    def close(self) -> None:
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
