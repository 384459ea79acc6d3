"""The wire protocol's messages: small versioned dataclasses (the codec is `codec.py`).

    client ── GenerateReq / Abort / EndProgram / FlushCache / GetInfo / GetCacheTree / Health ──▶ gateway ──▶ engine
    client ◀─ TokenChunk / Finished / ErrorMsg / FlushDone / Info / CacheTree / HealthOk ── gateway ◀── engine
    gateway ◀── EngineReady, Heartbeat, Batch(TokenChunk | Finished | ErrorMsg | CacheEvents) ── engine

Between the client and the gateway a message travels as two frames, [api key, body];
between the gateway and the engine, as the body alone.

Versions: version 2 added the program context (GenerateReq.call, EndProgram); version 3 the
replicas' cache events (CacheEvents, engine -> gateway only); version 4 the model's EOS ids
(EngineReady.eos_token_ids, engine -> gateway only); version 5 the field a request was refused
for (ErrorMsg.param, engine -> gateway only: the gateway's HTTP front names it, and it leaves it
out of what it sends ZeroMQ clients). This side reads
versions MIN_PROTOCOL_VERSION to PROTOCOL_VERSION and refuses a message or field newer than the
version it claims. It writes each message at the lowest version that carries it
(`wire_version`), without the newer fields it leaves unset, so a side that speaks only version 1
reads everything but the program context. `version` is what the message was read at; equality
ignores it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stemma.outputs import RequestOutput
from stemma.program_call import ProgramCall
from stemma.sampling_params import SamplingParams

__all__ = ['PROTOCOL_VERSION', 'MIN_PROTOCOL_VERSION', 'DEFAULT_MAX_FRAME_BYTES', 'MAX_ID_CHARS', 'BAD_REQUEST', 'TOO_LARGE', 'UNAUTHORIZED', 'ENGINE_DEAD', 'SHUTTING_DOWN', 'OVERLOADED', 'CUT_OFF', 'INTERNAL', 'ProtocolError', 'Message', 'GenerateReq', 'Abort', 'EndProgram', 'FlushCache', 'GetInfo', 'GetCacheTree', 'Health', 'TokenChunk', 'Finished', 'ErrorMsg', 'FlushDone', 'Info', 'CacheTree', 'HealthOk', 'EngineReady', 'Heartbeat', 'CacheEvents', 'Batch', 'CLIENT_REQUESTS']

PROTOCOL_VERSION = 5
MIN_PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 8 << 20
MAX_ID_CHARS = 256

# ErrorMsg codes
BAD_REQUEST = "bad_request"        # malformed frame or invalid request; the connection stays usable
TOO_LARGE = "too_large"            # a frame over the size limit
UNAUTHORIZED = "unauthorized"      # missing or wrong API key
ENGINE_DEAD = "engine_dead"        # the engine process died or hung; the message says why, and
                                   # whether it is restarting (retry shortly) or the server stops
SHUTTING_DOWN = "shutting_down"    # the server is stopping
OVERLOADED = "overloaded"          # the engine's queue is full; retry later
CUT_OFF = "cut_off"                # the client did not read its replies: its requests were aborted
INTERNAL = "internal"              # a bug in the server (its log has the traceback)


class ProtocolError(ValueError):
    """A frame that is not a valid message. `rid` is its request id when one could be read."""

    def __init__(self, message: str, rid: str = ""):
        super().__init__(message)
        self.rid = rid


_TYPES: dict[str, type["Message"]] = {}


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message; `TAG` names it on the wire."""
    TAG: ClassVar[str] = ""
    SINCE: ClassVar[int] = 1  # the protocol version that added this message
    FIELDS_SINCE: ClassVar[dict[str, int]] = {}  # later fields (None when unset) -> their version
    version: int = field(default=PROTOCOL_VERSION, compare=False)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.TAG in _TYPES:
            raise TypeError(f"message tag {cls.TAG!r} is used twice")
        _TYPES[cls.TAG] = cls

    def __post_init__(self):
        if not MIN_PROTOCOL_VERSION <= self.version <= PROTOCOL_VERSION:
            raise ValueError(f"protocol version {self.version} is not supported (this side speaks "
                             f"versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION})")
        if self.version < self.SINCE:
            raise ValueError(f"a {self.TAG!r} message needs protocol version {self.SINCE} or later")
        for name, since in self.FIELDS_SINCE.items():
            if getattr(self, name) is not None and self.version < since:
                raise ValueError(f"{self.TAG}.{name} needs protocol version {since} or later")
        rid = getattr(self, "rid", None)
        if rid is not None and not 0 < len(rid) <= MAX_ID_CHARS and self.TAG != "error":
            raise ValueError(f"rid must hold 1 to {MAX_ID_CHARS} characters, got {len(rid)}")

    def wire_version(self) -> int:
        """The lowest protocol version that carries this message as it is."""
        return max([self.SINCE, *(since for name, since in self.FIELDS_SINCE.items()
                                  if getattr(self, name) is not None)])


# ---- requests (client -> gateway -> engine) ----
@dataclass(frozen=True, kw_only=True)
class GenerateReq(Message):
    """One prompt, as text or as token ids (exactly one of the two)."""
    TAG: ClassVar[str] = "generate"
    FIELDS_SINCE: ClassVar[dict[str, int]] = {"call": 2}
    rid: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False           # chunks of all n sequences, each with its index
    salt: str | None = None
    program: str | None = None     # the frontend program that sent it (shown on the dashboard)
    call: ProgramCall | None = None  # the program context (version 2): see stemma.program_call

    def __post_init__(self):
        super().__post_init__()
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("a generate request needs exactly one of prompt and input_ids")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids must hold at least one token")
        for name in ("salt", "program"):
            value = getattr(self, name)
            if value is not None and len(value) > MAX_ID_CHARS:
                raise ValueError(f"{name} must hold at most {MAX_ID_CHARS} characters")


@dataclass(frozen=True, kw_only=True)
class Abort(Message):
    """Stops a request; its Finished comes back with finish_reason 'abort'. Unknown ids are ignored."""
    TAG: ClassVar[str] = "abort"
    rid: str


@dataclass(frozen=True, kw_only=True)
class EndProgram(Message):
    """Program `program_id` has ended: it calls no more, so a program-aware engine evicts its
    KV first. No reply; an unknown id is ignored."""
    TAG: ClassVar[str] = "end_program"
    SINCE: ClassVar[int] = 2
    rid: str
    program_id: str

    def __post_init__(self):
        super().__post_init__()
        ProgramCall(self.program_id)  # checks the id


@dataclass(frozen=True, kw_only=True)
class FlushCache(Message):
    TAG: ClassVar[str] = "flush_cache"
    rid: str


@dataclass(frozen=True, kw_only=True)
class GetInfo(Message):
    """`check_pool` False skips the KV pool audit (stemma's periodic stats poll: cheap)."""
    TAG: ClassVar[str] = "get_info"
    rid: str
    check_pool: bool = True


@dataclass(frozen=True, kw_only=True)
class GetCacheTree(Message):
    """The radix tree's `limit` biggest subtrees and the requests in the scheduler (a CacheTree)."""
    TAG: ClassVar[str] = "get_cache_tree"
    rid: str
    limit: int = 20

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.limit <= 1000:
            raise ValueError(f"limit must be in [1, 1000], got {self.limit}")


@dataclass(frozen=True, kw_only=True)
class Health(Message):
    """Answered by the engine loop itself, so a reply proves the whole path is alive."""
    TAG: ClassVar[str] = "health"
    rid: str


# ---- replies ----
@dataclass(frozen=True, kw_only=True)
class TokenChunk(Message):
    """New tokens of a streamed request. The engine sends ids only; the gateway adds `text`."""
    TAG: ClassVar[str] = "chunk"
    rid: str
    index: int = 0
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True, kw_only=True)
class Finished(Message):
    """The whole output of one of a request's `n` sequences; `text` is filled in by the gateway."""
    TAG: ClassVar[str] = "finished"
    rid: str
    index: int = 0
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, out: RequestOutput, rid: str, index: int = 0) -> Finished:
        """The message carrying `out` as sequence `index` of request `rid`."""
        return cls(rid=rid, index=index, **{name: getattr(out, name) for name in _OUTPUT_FIELDS})

    def output(self, rid: str) -> RequestOutput:
        """The RequestOutput this message carries, under request id `rid`."""
        fields = {name: getattr(self, name) for name in _OUTPUT_FIELDS}
        if self.top_logprobs is not None:  # msgpack has no tuples: (token id, logprob) pairs again
            fields["top_logprobs"] = [[tuple(t) for t in pos] for pos in self.top_logprobs]
        return RequestOutput(rid=rid, **fields)


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput) if f.name != "rid")


@dataclass(frozen=True, kw_only=True)
class ErrorMsg(Message):
    """A request failed. `rid` is empty when the failing frame's id could not be read. `param`
    (version 5): the request field it was refused for, a SamplingParams field or "prompt"."""
    TAG: ClassVar[str] = "error"
    FIELDS_SINCE: ClassVar[dict[str, int]] = {"param": 5}
    rid: str
    code: str
    message: str
    param: str | None = None


@dataclass(frozen=True, kw_only=True)
class FlushDone(Message):
    """`ok` is False while requests run (the cache is then left as it is)."""
    TAG: ClassVar[str] = "flush_done"
    rid: str
    ok: bool


@dataclass(frozen=True, kw_only=True)
class Info(Message):
    TAG: ClassVar[str] = "info"
    rid: str
    model: str
    context_length: int
    vocab_size: int
    stats: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class CacheTree(Message):
    """`nodes`: dicts {id, parent (an id, or None for a child of a root), tokens (the node's own
    edge, token ids), depth (tokens from the root to the node's end), size (tokens in its
    subtree), hits (requests whose cached prefix at their first admission passed through the
    node), locks (locks held at the node or below it)}, parents before children. `requests`: dicts {rid (the engine-side id),
    state ("running", "waiting" or "grammar": its constraint is being built), prompt_tokens,
    output_tokens, cached_tokens}; the gateway adds client_rid and program on the way back."""
    TAG: ClassVar[str] = "cache_tree"
    rid: str
    nodes: list[dict[str, Any]]
    requests: list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class HealthOk(Message):
    TAG: ClassVar[str] = "health_ok"
    rid: str


# ---- engine -> gateway only ----
@dataclass(frozen=True, kw_only=True)
class EngineReady(Message):
    """The engine's first message, once the model is loaded."""
    TAG: ClassVar[str] = "engine_ready"
    FIELDS_SINCE: ClassVar[dict[str, int]] = {"eos_token_ids": 4}
    model: str
    context_length: int
    vocab_size: int
    pid: int = 0                   # the engine process, which the gateway watches
    eos_token_ids: list[int] | None = None  # the model's EOS ids (version 4): their text is left out


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """The engine loop is alive: sent between steps at least every HEARTBEAT_PERIOD_S once ready.
    A gateway that hears nothing from the engine for longer than its engine timeout takes it for
    hung."""
    TAG: ClassVar[str] = "heartbeat"
    sent: float                    # the engine's time.monotonic() at sending


@dataclass(frozen=True, kw_only=True)
class CacheEvents(Message):
    """What changed in the engine's radix tree since its last CacheEvents, in order (sent only
    when the gateway asks for them: replicas behind a cache-aware router). Each event is
    `[op, keep, salt, *tokens]`, `salt` an index into `salts` (-1: no salt):
    - op 1 (store): `tokens` and all their prefixes are cached;
    - op 0 (remove): the prefixes of `tokens` longer than `keep` are gone (an evicted leaf);
    - op 2 (clear): nothing is cached any more (`tokens` empty)."""
    TAG: ClassVar[str] = "cache_events"
    SINCE: ClassVar[int] = 3
    STORE: ClassVar[int] = 1
    REMOVE: ClassVar[int] = 0
    CLEAR: ClassVar[int] = 2
    events: list[list[int]]
    salts: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Batch(Message):
    """Everything one engine step produced, in order, as one frame."""
    TAG: ClassVar[str] = "batch"
    items: list[TokenChunk | Finished | ErrorMsg | CacheEvents]


CLIENT_REQUESTS = (GenerateReq, Abort, EndProgram, FlushCache, GetInfo, GetCacheTree, Health)
