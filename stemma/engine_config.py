"""EngineConfig: every engine option, in one frozen dataclass validated once."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

from stemma.field_doc import doc, one_of
from stemma.registry import ATTENTION_BACKENDS, POLICIES

BATCHING = ("continuous", "dynamic", "static")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # how weight matrices are held (stemma.loader.quantize)
INT4_GROUP_SIZES = (32, 64, 128)
MAX_DRAFT_TOKENS = 16
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")  # loader.model.resolve_dtype


# The seed's two scenarios and the middle: each preset sets these fields unless they are given.
PRESETS: dict[str, dict[str, Any]] = {
    # chat: small, fluid batches; every step kept within 2 one-row decode steps, first tokens
    # within a second, prompts prefilled in short chunks between decode steps
    "interactive": {"max_running_requests": 32, "chunked_prefill_size": 256, "schedule_policy": "fcfs",
                    "default_itl_slo_steps": 2.0, "default_ttft_slo_ms": 1000.0},
    "balanced": {"max_running_requests": 64, "chunked_prefill_size": 512, "default_itl_slo_steps": 4.0},
    # batch processing: large, stable batches, long prefill chunks, prefix reuse first, no targets
    "throughput": {"max_running_requests": 256, "chunked_prefill_size": 4096,
                   "max_prefill_tokens": 16384, "schedule_policy": "lpm"},
}


@dataclass(frozen=True)
class EngineConfig:
    """Each field's help text is its `stemma ... --help` description (see stemma.field_doc)."""
    model: str | None = doc(None, "a GGUF file or a Hugging Face model folder; not given: the "
                                  "default model, Gemma 3 270M (base) Q4_K_M")
    dtype: str = doc("auto", "activation and dense-weight precision; auto: bf16 on CUDA and on "
                             "CPUs with native bf16, else float32",
                     values=DTYPES)
    quantization: str = one_of("auto", QUANTIZATIONS, "how weight matrices are held; auto: the "
                               "fastest plan that passes the quality gate (stemma.loader.quantize)")
    int4_group_size: int = one_of(64, INT4_GROUP_SIZES, "weights per int4 scale and zero point")
    device: str = doc("auto", "auto, cpu, cuda or cuda:N; auto: cuda when available, else cpu")
    tp: int = doc(1, "tensor-parallel ranks: one engine over this many processes, each holding a "
                     "slice of every matrix (gloo on CPU, NCCL on CUDA, rank k on cuda:k)")
    kv_pool_tokens: int = doc(65536, "KV cache slots (tokens) shared by all requests and the "
                                     "radix cache")
    max_running_requests: int = doc(128, "most requests in one batch")
    max_context: int | None = doc(None, "longest prompt + output in tokens; not given: the "
                                        "model's context length")
    chunked_prefill_size: int | None = doc(2048, "longest prompt chunk prefilled in one step; "
                                                 "<= 0: no chunking")
    max_prefill_tokens: int = doc(8192, "prefill tokens admitted in one step")
    schedule_policy: str = one_of("lpm", POLICIES.names(), "the order waiting requests are "
                                  "admitted in; lpm: longest cached prefix first")
    batching: str = one_of("continuous", BATCHING, "continuous: requests join and leave every "
                           "step; dynamic: a batch forms when none runs; static: fixed batches "
                           "run to the end")
    compile_decode: str = one_of("auto", ("auto", "on", "off"), "decode forwards compiled by "
                                 "torch.compile (Inductor), one graph per bucket of batch sizes; "
                                 "auto (CPU only): after the first 128 decode forwards, each bucket "
                                 "met is compiled in the background and kept if it measures faster "
                                 "(STEMMA_COMPILE=0: off); on: the one-request graph at load, the "
                                 "others when first met (stemma.executor.compiled_decode)")
    dynamic_wait_ms: float = doc(20.0, "dynamic batching: how long a batch waits to fill")
    enable_radix_cache: bool = doc(True, "reuse the KV of every shared prefix (the radix cache)")
    attention_backend: str = one_of("auto", ("auto", *ATTENTION_BACKENDS.names()),
                                    "attention kernels; auto: triton on CUDA, else torch")
    kv_reserve_ratio: float = doc(0.3, "share of running decodes' remaining tokens kept free in "
                                       "the KV pool; in [0, 1]")
    lpm_fallback_queue: int = doc(128, "lpm orders as fcfs past this many waiting requests")
    radix_eviction: str = one_of("lru", ("lru", "program"), "which cached prefixes go first "
                                 "when the KV pool is short; program: those of ended programs, "
                                 "then expired retentions, then least recently used, and last "
                                 "the KV of programs paused between calls (stemma.engine.programs)")
    program_retention_s: float = doc(30.0, "longest a paused program's KV is retained ahead of "
                                           "other cached prefixes (radix_eviction program)")
    program_starvation_s: float = doc(15.0, "a program call waiting longer than this is admitted "
                                            "first, whatever its program's attained service, and "
                                            "may evict other programs' retained KV "
                                            "(schedule_policy program)")
    random_seed: int | None = doc(None, "seeds the engine's RNG for unseeded sampled requests; not given: "
                                        "seeded from the OS")
    enable_jump_forward: bool = doc(True, "constrained decoding appends forced text unsampled")
    constraint_cache_size: int = doc(64, "outlines-core Indexes kept (one per regex or JSON schema)")
    constraint_budget_closure: bool = doc(True, "constrained output closes within its token budget")
    speculative: str = doc("ngram", "speculative decoding: ngram (the default), none or draft:<model path> "
                                   "(stemma.speculative)")
    speculative_max_tokens: int = doc(8, f"most draft tokens a request verifies in one step; in "
                                         f"[1, {MAX_DRAFT_TOKENS}]")
    speculative_max_verify_steps: float = doc(1.5, "a step that verifies drafts is planned to "
                                                   "take at most this many one-row decode steps "
                                                   "of this machine (eager, as the drafts' cost "
                                                   "fit predicts it): its time is the gap before "
                                                   "each of its tokens, so this bounds what "
                                                   "speculation adds to the inter-token latency "
                                                   "tail; inf: no bound")
    # limits on one request (stemma.engine.limits): past one, submission fails naming it
    max_prompt_tokens: int | None = doc(None, "longest prompt in tokens; not given: the context "
                                              "length less one")
    max_new_tokens_limit: int | None = doc(None, "largest max_new_tokens a request may ask; not "
                                                 "given: any (the context ends every output)")
    max_n: int = doc(64, "most outputs one request may sample (its n)")
    max_stop_strings: int = doc(64, "most stop strings one request may give")
    max_stop_chars: int = doc(1024, "longest stop string, in characters")
    max_logit_bias: int = doc(1024, "most logit_bias entries one request may give")
    max_prompt_logprobs: int = doc(4096, "most prompt positions one request may score (its prompt "
                                         "length less logprob_start)")
    constraint_timeout_s: float = doc(60.0, "seconds a regex, JSON schema or grammar may take to "
                                            "compile (both its check and its build); past it the "
                                            "request fails")
    # SLO scheduling (stemma.engine.slo): defaults for requests that name no target
    default_itl_slo_ms: float | None = doc(None, "inter-token latency target in ms for requests "
                                                 "that give none; not given: no target")
    default_itl_slo_steps: float | None = doc(None, "the same target as a multiple of this "
                                                    "machine's one-row decode step (measured at "
                                                    "load); default_itl_slo_ms wins")
    default_ttft_slo_ms: float | None = doc(None, "time-to-first-token target in ms for requests "
                                                  "that give none; not given: no target")
    priority_preemption_gap: int = doc(10, "a waiting request preempts running ones whose "
                                           "priority is at least this much lower")
    preset: str | None = doc(None, "interactive, balanced or throughput: sets the batch, chunk, "
                                   "policy and latency-target options not given explicitly "
                                   "(see PRESETS)", values=tuple(PRESETS))
    heap_trim_interval_s: float = doc(5.0, "the engine process hands freed heap memory back to "
                                           "the OS (glibc malloc_trim) at most this often while "
                                           "busy, and when it falls idle; 0: never "
                                           "(stemma.engine.heap)")
    gc_freeze: bool = doc(True, "the engine process freezes its long-lived heap (gc.freeze: no "
                                "full collection scans it again) once ready and, at its next "
                                "idle moment, after each run of compiles (stemma.gc_pauses)")

    def __post_init__(self):
        def positive(name):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_pool_tokens", "max_running_requests", "max_prefill_tokens", "lpm_fallback_queue",
                     "constraint_cache_size", "max_n", "max_stop_strings", "max_stop_chars",
                     "max_logit_bias", "max_prompt_logprobs"):
            positive(name)
        for name in ("max_prompt_tokens", "max_new_tokens_limit"):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("default_itl_slo_ms", "default_itl_slo_steps", "default_ttft_slo_ms"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.priority_preemption_gap < 1:
            raise ValueError(f"priority_preemption_gap must be >= 1, got {self.priority_preemption_gap}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.heap_trim_interval_s < 0:
            raise ValueError(f"heap_trim_interval_s must be >= 0, got {self.heap_trim_interval_s}")
        for name in ("program_retention_s", "program_starvation_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.constraint_timeout_s > 0:
            raise ValueError(f"constraint_timeout_s must be > 0, got {self.constraint_timeout_s}")
        for f in fields(self):
            allowed, value = f.metadata.get("choices"), getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(f"{f.name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.tp > 1 and self.speculative.startswith("draft:"):
            raise ValueError("speculative=draft:<model> does not run with tp > 1 (the draft model "
                             "is not split); use ngram or none")
        if not 0.0 <= self.kv_reserve_ratio <= 1.0:
            raise ValueError(f"kv_reserve_ratio must be in [0, 1], got {self.kv_reserve_ratio}")
        if self.dynamic_wait_ms < 0:
            raise ValueError(f"dynamic_wait_ms must be >= 0, got {self.dynamic_wait_ms}")
        if self.speculative not in ("none", "ngram") and not (
                self.speculative.startswith("draft:") and len(self.speculative) > len("draft:")):
            raise ValueError(f"speculative must be none, ngram or draft:<model path>, got "
                             f"{self.speculative!r}")
        if not self.speculative_max_verify_steps >= 1.0:
            raise ValueError(f"speculative_max_verify_steps must be >= 1 (inf: no bound), got "
                             f"{self.speculative_max_verify_steps}")
        if not 1 <= self.speculative_max_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_max_tokens must be in [1, {MAX_DRAFT_TOKENS}], got "
                             f"{self.speculative_max_tokens}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")

    @property
    def has_default_targets(self) -> bool:
        """Whether the engine gives requests that name none a latency target."""
        return (self.default_itl_slo_ms, self.default_itl_slo_steps, self.default_ttft_slo_ms) != (None, None, None)

    @property
    def chunk_size(self) -> int | None:
        return self.chunked_prefill_size if self.chunked_prefill_size and self.chunked_prefill_size > 0 else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine options: {', '.join(unknown)}")
        # what is given wins over the preset; an unknown preset adds nothing and __post_init__ names it
        return cls(**{**PRESETS.get(kwargs.get("preset"), {}), **kwargs})
