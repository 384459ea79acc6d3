"""EngineConfig: every engine option, in one frozen dataclass validated once."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from stemma.registry import ATTENTION_BACKENDS, POLICIES

BATCHING = ("continuous", "dynamic", "static")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # how weight matrices are held (stemma.loader.quantize)
INT4_GROUP_SIZES = (32, 64, 128)
MAX_DRAFT_TOKENS = 16


def one_of(default: str | int, names: Sequence[str | int]) -> Any:
    """A field whose value must be one of `names`: validated in __post_init__, and argparse
    `choices` for its flag (stemma.cli_args reads the field's metadata)."""
    return field(default=default, metadata={"choices": tuple(names)})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None              # None: the default Gemma 3 270M GGUF
    dtype: str = "auto"                   # auto: bf16 on CUDA and on CPUs with native bf16
    quantization: str = one_of("auto", QUANTIZATIONS)  # auto: a GGUF keeps its tensors' precision
    int4_group_size: int = one_of(64, INT4_GROUP_SIZES)  # weights per int4 scale and zero point
    device: str = "auto"                  # auto: cuda when available, else cpu
    kv_pool_tokens: int = 65536
    max_running_requests: int = 128
    max_context: int | None = None        # None: the model's context length
    chunked_prefill_size: int | None = 2048  # None or <= 0: no chunking
    max_prefill_tokens: int = 8192        # prefill tokens admitted in one step
    schedule_policy: str = one_of("lpm", POLICIES.names())
    batching: str = one_of("continuous", BATCHING)
    dynamic_wait_ms: float = 20.0         # dynamic batching: how long a batch waits to fill
    enable_radix_cache: bool = True
    attention_backend: str = one_of("auto", ("auto", *ATTENTION_BACKENDS.names()))  # auto: triton on CUDA
    kv_reserve_ratio: float = 0.3         # share of running decodes' remaining tokens kept free
    lpm_fallback_queue: int = 128         # lpm orders as fcfs past this many waiting requests
    random_seed: int | None = None        # seeds the RNG of unseeded sampled requests
    enable_jump_forward: bool = True      # constrained decoding appends forced text unsampled
    constraint_cache_size: int = 64       # outlines-core Indexes kept (one per regex/JSON schema)
    constraint_budget_closure: bool = True  # constrained output closes within its token budget
    speculative: str = "none"             # none | ngram | draft:<model path> (stemma.speculative)
    speculative_max_tokens: int = 8       # most draft tokens a request verifies in one step

    def __post_init__(self):
        def positive(name):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_pool_tokens", "max_running_requests", "max_prefill_tokens", "lpm_fallback_queue",
                     "constraint_cache_size"):
            positive(name)
        for f in fields(self):
            allowed, value = f.metadata.get("choices"), getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(f"{f.name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not 0.0 <= self.kv_reserve_ratio <= 1.0:
            raise ValueError(f"kv_reserve_ratio must be in [0, 1], got {self.kv_reserve_ratio}")
        if self.dynamic_wait_ms < 0:
            raise ValueError(f"dynamic_wait_ms must be >= 0, got {self.dynamic_wait_ms}")
        if self.speculative not in ("none", "ngram") and not (
                self.speculative.startswith("draft:") and len(self.speculative) > len("draft:")):
            raise ValueError(f"speculative must be none, ngram or draft:<model path>, got "
                             f"{self.speculative!r}")
        if not 1 <= self.speculative_max_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_max_tokens must be in [1, {MAX_DRAFT_TOKENS}], got "
                             f"{self.speculative_max_tokens}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")

    @property
    def chunk_size(self) -> int | None:
        return self.chunked_prefill_size if self.chunked_prefill_size and self.chunked_prefill_size > 0 else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine options: {', '.join(unknown)}")
        return cls(**kwargs)
