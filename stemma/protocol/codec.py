"""The one msgpack codec that carries every message (see messages): `encode`, `decode`.

A frame is one msgpack map: {"type": tag, "version": v, <fields>} (v: the lowest version that
carries the message, see messages). `decode`
checks the size, the msgpack itself, the tag, the version and every field's type, and raises
`ProtocolError` (with the request id when one could be read) for anything malformed. Nothing is
ever pickled.
"""
from __future__ import annotations

import dataclasses
import io
import typing
from typing import Any

import msgpack

from stemma.program_call import ProgramCall
from stemma.protocol.messages import (_TYPES, DEFAULT_MAX_FRAME_BYTES, MAX_ID_CHARS, MIN_PROTOCOL_VERSION,
                                      PROTOCOL_VERSION, Message, ProtocolError)
from stemma.protocol.wire_types import WireTypeError, coerce
from stemma.sampling_params import SamplingParams

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


def _required(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return to_wire(value)
    if isinstance(value, SamplingParams):
        return value.to_dict(omit_defaults=True)
    if isinstance(value, ProgramCall):
        return value.to_dict()
    if isinstance(value, list) and value and isinstance(value[0], Message):
        return [to_wire(v) for v in value]
    return value


def to_wire(msg: Message) -> dict[str, Any]:
    """The message's map, at the lowest version that carries it (Message.wire_version), without
    the later fields it leaves unset."""
    out = {"type": msg.TAG}
    for name in _hints(type(msg)):
        value = getattr(msg, name)
        if value is None and name in msg.FIELDS_SINCE:
            continue
        out[name] = _plain(value)
    out["version"] = msg.wire_version()
    return out


def _custom(value: Any, cls: type, where: str) -> Any:
    if cls in (SamplingParams, ProgramCall):
        if not isinstance(value, dict):
            raise WireTypeError(f"{where} must be a map, got {type(value).__name__}")
        try:
            return cls.from_dict(value)
        except (ValueError, TypeError) as exc:
            raise WireTypeError(f"{where}: {exc}") from None
    if isinstance(cls, type) and issubclass(cls, Message):
        if not isinstance(value, dict) or value.get("type") != cls.TAG:
            raise WireTypeError(f"{where} must be a {cls.TAG!r} message")
        try:
            return from_wire(value, (cls,))
        except ProtocolError as exc:
            raise WireTypeError(f"{where}: {exc}") from None
    raise TypeError(f"{where}: no rule to decode {cls!r}")


def from_wire(data: Any, allowed: tuple[type[Message], ...] | None = None) -> Message:
    """The message a decoded map describes; raises ProtocolError."""
    if not isinstance(data, dict):
        raise ProtocolError(f"a message must be a map, got {type(data).__name__}")
    rid = data.get("rid") if isinstance(data.get("rid"), str) else ""
    tag = data.get("type")
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}", rid)
    if allowed is not None and cls not in allowed:
        raise ProtocolError(f"a {tag!r} message is not accepted here", rid)
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise ProtocolError(f"{tag}: protocol version {version!r} is not supported (this side speaks "
                            f"versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION})", rid)
    hints = _hints(cls)
    unknown = sorted(map(str, set(data) - set(hints) - {"type"}))
    if unknown:
        raise ProtocolError(f"{tag}: unknown fields {', '.join(unknown)}", rid)
    missing = [name for name in _required(cls) if name not in data]
    if missing:
        raise ProtocolError(f"{tag}: missing fields {', '.join(missing)}", rid)
    try:
        kwargs = {name: coerce(data[name], hint, f"{tag}.{name}", _custom)
                  for name, hint in hints.items() if name in data}
        return cls(**kwargs)
    except ValueError as exc:
        raise ProtocolError(str(exc) if isinstance(exc, WireTypeError) else f"{tag}: {exc}", rid) from None


def peek_rid(frame: bytes, max_keys: int = 16) -> str:
    """The `rid` of the message map in `frame`, read without decoding its other values (an
    oversize frame's error then goes to its own request, not to all of its peer's); "" when
    there is none to read."""
    try:
        unpacker = msgpack.Unpacker(io.BytesIO(frame), raw=False, max_ext_len=0,
                                    max_buffer_size=len(frame) + 1)
        for _ in range(min(unpacker.read_map_header(), max_keys)):
            if unpacker.unpack() == "rid":
                rid = unpacker.unpack()
                return rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else ""
            unpacker.skip()
    except Exception:  # not a map, cut short, or not msgpack: no rid to read
        pass
    return ""


def encode(msg: Message) -> bytes:
    return msgpack.packb(to_wire(msg), use_bin_type=True)


def decode(frame: bytes, allowed: tuple[type[Message], ...] | None = None,
           max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """The message in `frame`; `allowed` restricts its type. Raises ProtocolError."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the limit of {max_bytes} bytes",
                            peek_rid(frame))
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_ext_len=0,
                               max_str_len=max_bytes, max_bin_len=max_bytes,
                               max_array_len=max_bytes, max_map_len=max_bytes)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        detail = f": {exc}" if str(exc) else ""
        raise ProtocolError(f"not a valid msgpack frame ({type(exc).__name__}{detail})") from None
    return from_wire(data, allowed)
