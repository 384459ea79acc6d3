"""Server addresses: the forms `stemma.connect` takes, checked where an address is given (no
network), and the probe that tells which protocol a port speaks once a call has failed.

    tcp://host:port      a server's ZeroMQ port (`stemma serve --zmq-port`, 30001 by default)
    ipc:///path          a ZeroMQ socket on this machine
    http://host:port     a server's HTTP port (`stemma serve --port`, 30000 by default); https://
"""
from __future__ import annotations

import socket
from urllib.parse import urlsplit

ACCEPTED = ("tcp://host:port (the server's ZeroMQ port), http://host:port or https://host[:port] "
            "(its HTTP port), or ipc:///path (a local ZeroMQ socket)")
ZMQ_SCHEMES = ("tcp", "ipc")
HTTP_SCHEMES = ("http", "https")
ZMTP_SIGNATURE = (0xFF, 0x7F)  # a ZeroMQ peer's greeting: 0xFF, 8 padding bytes, 0x7F; sent first


def _bad(address: object, why: str) -> ValueError:
    return ValueError(f"{address!r} is not a server address: {why}; give {ACCEPTED}")


def check(address: object) -> str:
    """`address`'s kind, "zmq" or "http"; a ValueError naming the accepted forms otherwise."""
    if not isinstance(address, str):
        raise _bad(address, f"an address is a string, got {type(address).__name__}")
    parts = urlsplit(address)
    if "://" not in address:
        host = address.strip().rstrip("/") or "host:port"
        raise ValueError(f"{address!r} is not a server address: it names no protocol; give "
                         f"tcp://{host} for the server's ZeroMQ port or http://{host} for its "
                         f"HTTP port ({ACCEPTED})")
    scheme = parts.scheme.lower()
    if scheme == "ipc":
        if not (parts.netloc + parts.path):
            raise _bad(address, "ipc:// needs a path")
        return "zmq"
    if scheme not in ZMQ_SCHEMES + HTTP_SCHEMES:
        raise _bad(address, f"{scheme}:// is not a protocol stemma speaks")
    if not parts.hostname:
        raise _bad(address, "it names no host")
    try:
        port = parts.port
    except ValueError:
        raise _bad(address, "its port is not a number in [1, 65535]") from None
    if port == 0:
        raise _bad(address, "its port is not a number in [1, 65535]")
    if scheme == "tcp":
        if port is None:
            raise _bad(address, "tcp:// needs a port")
        if parts.path or parts.query:  # ZeroMQ's connect refuses even a trailing /
            raise _bad(address, f"tcp:// takes host:port only: tcp://{parts.netloc}")
        return "zmq"
    if parts.path.rstrip("/").endswith("/v1"):  # every call would be "no such route"
        root = f"{scheme}://{parts.netloc}{parts.path.rstrip('/')[:-3]}"
        raise _bad(address, f"/v1 is the OpenAI API's base (for OpenAI clients); stemma.connect "
                            f"takes the server itself: {root}")
    return "http"


def speaks_zmtp(address: str, wait_s: float = 0.5, ask_http: bool = False) -> bool:
    """Whether the tcp/http `address` is a ZeroMQ port: one that greets a new connection with a
    ZMTP signature before it is sent anything (an HTTP server waits for the request). `ask_http`:
    send an HTTP request at once too, which an HTTP server answers without waiting out `wait_s`
    (a ZeroMQ port's greeting still comes first)."""
    parts = urlsplit(address)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=wait_s) as sock:
            sock.settimeout(wait_s)
            if ask_http:
                sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            greeting = sock.recv(10)
    except OSError:
        return False
    return len(greeting) == 10 and (greeting[0], greeting[-1]) == ZMTP_SIGNATURE


def zmq_twin(address: str) -> str:
    """The tcp:// form of an http(s):// address (the same host and port)."""
    parts = urlsplit(address)
    return f"tcp://{parts.netloc}"
