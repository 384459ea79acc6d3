"""The model runner: owns the model, the KV pool and the req->slot table, and runs one forward."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from stemma.attention.select import make_attention_backend
from stemma.executor.compile_gate import GATE
from stemma.executor.compiled_decode import CompiledDecode, resolve_mode
from stemma.executor.forward_batch import ForwardBatch
from stemma.cache.kv_pool import KVPool, ReqToSlot
from stemma.models.layers import ForwardContext
from stemma.models.row_ops import EAGER, RowOps
from stemma.executor.tensor_parallel import Workers
from stemma.executor.trace_guard import forwarding
from stemma.loader.model import LoadedModel


@dataclass(frozen=True)
class RunnerConfig:
    kv_pool_tokens: int = 65536
    max_running_requests: int = 256
    max_context: int | None = None    # None: the model's max_position_embeddings, capped by the pool
    attention_backend: str = "auto"
    compile_decode: str = "off"       # on | auto | off (stemma.executor.compiled_decode)

    def __post_init__(self):
        if self.kv_pool_tokens < 16:
            raise ValueError(f"kv_pool_tokens must be >= 16, got {self.kv_pool_tokens}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")


class ModelRunner:
    """`workers`: the other ranks of a tensor-parallel engine (executor.tensor_parallel), sent
    every forward before this rank runs its own."""

    def __init__(self, loaded: LoadedModel, config: RunnerConfig = RunnerConfig(),
                 workers: Workers | None = None):
        self.loaded = loaded
        self.workers = workers
        self.model = loaded.model
        self.spec = spec = loaded.spec
        self.config = config
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_context = min(config.max_context or spec.max_position_embeddings,
                               spec.max_position_embeddings, config.kv_pool_tokens)
        self.pool = KVPool(spec.num_layers, config.kv_pool_tokens, spec.num_kv_heads, spec.head_dim,
                           self.dtype, self.device)
        # one spare row, so a full running set can still hold a request being admitted
        self.req_to_slot = ReqToSlot(config.max_running_requests + 1, self.max_context, self.device)
        self.backend = make_attention_backend(config.attention_backend, self.device, spec.layer_windows)
        mode = resolve_mode(config.compile_decode, self.device, config.attention_backend)
        self.compiled = CompiledDecode(self.model, self.pool, mode) if mode != "off" else None
        self.ran_compiled = False   # whether the last forward ran a compiled graph

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [K, vocab] at fb.logits_indices (model dtype; see CausalLM.forward). A
        background compile's Python waits meanwhile (executor.compile_gate)."""
        with GATE.forward():
            return self._forward(fb)

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.workers is not None:
            self.workers.send(fb)
        compiled = self.compiled
        self.ran_compiled = False
        if compiled is not None and compiled.wants(fb):
            logits = compiled.forward(fb)
            if logits is not None:
                self.ran_compiled = True
                return logits
        ops = compiled.row_ops(fb.num_tokens) if compiled is not None else EAGER  # (may hold the trial first)
        t0 = time.perf_counter()
        logits = self._eager(fb, ops)
        if compiled is not None:
            compiled.timed(fb, False, time.perf_counter() - t0)
        return logits

    def _eager(self, fb: ForwardBatch, ops: RowOps) -> torch.Tensor:
        """The eager forward with `ops`; if the compiled ones raise, again with the eager ones,
        which are then kept for good (rerunning writes the same KV slots again). A forward that
        raises eager too raises: the fault is the batch's, not the compiled ops'."""
        with forwarding():
            try:
                return self.model(ForwardContext(batch=fb, backend=self.backend, pool=self.pool, ops=ops))
            except Exception as exc:
                if ops is EAGER:
                    raise
                logits = self.model(ForwardContext(batch=fb, backend=self.backend, pool=self.pool, ops=EAGER))
                self.compiled.rows.fail(exc)
                return logits

    def one_offs(self) -> int:
        """How many one-off jobs forwards have held: the row ops' trials and the decode graphs'
        compiles begun (compile_decode=on compiles a bucket in the step that first meets it). A
        step in which this changed is no sample of what a step costs."""
        if self.compiled is None:
            return 0
        return self.compiled.rows.trials_run + self.compiled.compiles_started

    def prepare(self, token_lists, req_rows, prefix_lens, logit_starts=None) -> ForwardBatch:
        """Allocates slots for the new tokens, records them in the rows, and builds the batch."""
        n = sum(len(t) for t in token_lists)
        slots = self.pool.allocator.alloc(n)
        if slots is None:
            raise MemoryError(f"KV pool has {self.pool.allocator.available} free slots, {n} needed")
        offset = 0
        for row, p, toks in zip(req_rows, prefix_lens, token_lists):
            self.req_to_slot.write(row, p, slots[offset:offset + len(toks)])
            offset += len(toks)
        return ForwardBatch.build(token_lists=token_lists, req_rows=req_rows, prefix_lens=prefix_lens,
                                  out_slots=slots, req_to_slot=self.req_to_slot.table,
                                  logit_starts=logit_starts)
