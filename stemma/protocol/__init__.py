"""The wire format between clients, the gateway and the engine: message dataclasses and one
msgpack codec. Torch-free. `from stemma import protocol as P` gives both."""
from stemma.protocol.codec import decode, encode, from_wire, to_wire
from stemma.protocol.messages import *  # noqa: F403  (the messages, error codes and limits)
from stemma.protocol.messages import __all__ as _messages

__all__ = ["decode", "encode", "from_wire", "to_wire", *_messages]
