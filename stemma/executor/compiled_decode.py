"""The one-row decode forward compiled by Inductor (`torch.compile`), beside the eager one.

A one-row decode step on CPU reads every weight once, and in eager mode a third of it more went
to dispatching some 2,500 small ops: norms, casts, rope, the KV write and the attention glue
between the matmuls. Inductor fuses that glue into a few C++ loops per layer; the matmuls stay
the kernels the dispatch table chose (packed ones through the `stemma::packed_linear` op).

What runs compiled: forwards of one request decoding one token (batch 1, one new token), the
single-stream case; the decoder layers only (the embedding, the final norm and the output matrix
stay eager). The context length is a dynamic dimension, so one graph serves every length. Every
other forward runs eager.

Modes (`EngineConfig.compile_decode`):
- `on`: compiled in the constructor and used from then on.
- `auto` (CPU only; `STEMMA_COMPILE=0` makes it `off`, as the test suite does): once the engine
  has run START_AFTER forwards of a single request (decodes or speculative verifies: a
  single-stream user; a one-off command that decodes a few dozen tokens never pays for it), the graph is compiled on a background thread (15-30 s on
  2 cores; Inductor's on-disk cache shortens later starts) while steps run eager. Then the next
  TRIALS eligible forwards of each kind alternate, and the compiled graph is kept only if its
  median forward is faster: measured on the machine.
- `off`: eager only.
A compile or a compiled call that raises leaves the eager forward, logged once.

Invariants: the graph runs on its own attention backend (per-forward metadata lives on a
backend, and the compile thread must not touch the one the steps use). The compile's dummy
forward writes only KV slot 0, the padding slot that no request holds. Scales that modules cache
from their weights are refreshed eagerly before each compiled call (`CausalLM.refresh_cached`),
since a compiled graph reads them as they are.
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from types import FunctionType, MethodType

import torch

from stemma.attention.select import make_attention_backend
from stemma.cache.kv_pool import KVPool
from stemma.executor.forward_batch import ForwardBatch
from stemma.models.causal_lm import CausalLM
from stemma.models.layers import ForwardContext

logger = logging.getLogger(__name__)

COMPILE_ENV = "STEMMA_COMPILE"
START_AFTER = 128    # forwards of one request before auto starts compiling
TRIALS = 8          # timed forwards of each kind before auto keeps or drops the graph
DUMMY_CONTEXT = 16  # the compile's dummy request attends to this many (padding) slots + itself


def resolve_mode(mode: str, device: torch.device, attention_backend: str) -> str:
    """`on`, `auto` or `off` as it applies here: the compiled path is the CPU torch backend's."""
    if device.type != "cpu" or attention_backend not in ("auto", "torch"):
        return "off"
    if mode == "auto" and os.environ.get(COMPILE_ENV, "1") == "0":
        return "off"
    return mode


def _own_code(method: MethodType) -> MethodType:
    """`method` over a copy of its code object. Dynamo keeps compiled graphs per code object, and
    the graphs here skip the guards on modules: with its own code, a model's graph can never be
    offered to another model."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(method.__self__):x}")
    own = FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return MethodType(own, method.__self__)


class Trial:
    """Alternating timed forwards, compiled and eager, until each kind has `n`; then the verdict:
    True when the compiled median is the lower."""

    def __init__(self, n: int = TRIALS):
        self.n = n
        self.times: dict[bool, list[float]] = {True: [], False: []}

    def compiled_next(self) -> bool:
        return len(self.times[True]) <= len(self.times[False])

    def record(self, compiled: bool, seconds: float) -> None:
        self.times[compiled].append(seconds)

    def verdict(self) -> bool | None:
        if min(len(t) for t in self.times.values()) < self.n:
            return None
        return self.median_ms(True) < self.median_ms(False)

    def median_ms(self, compiled: bool) -> float | None:
        times = self.times[compiled]
        return 1e3 * statistics.median(times) if times else None


class CompiledDecode:
    def __init__(self, model: CausalLM, pool: KVPool, mode: str):
        self.model = model
        self.pool = pool
        self.backend = make_attention_backend("torch", "cpu")
        for matrix in model.matrices().values():  # stores are made on first use: here, not in a trace
            matrix.weights()
        # guards on the modules' attributes cost ~1 ms a call; this graph serves one model only
        self.graph = torch.compile(_own_code(model.decoder), dynamic=True, fullgraph=True,
                                   options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.state = "waiting"     # (auto) waiting -> compiling -> trial -> kept | dropped; or failed
        self.single_seen = 0       # forwards of one request (decode or verify) while waiting
        self.trial = Trial()
        self.compile_s: float | None = None
        self.calls = 0             # forwards the graph served
        self.thread: threading.Thread | None = None
        if mode == "on":
            self.state = "compiling"
            self._compile()
            if self.state == "trial":
                self.state = "kept"

    # ---- the compile ----
    def _compile(self) -> None:
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                self._run(ForwardBatch.on_padding_slot(1, DUMMY_CONTEXT))
        except Exception as exc:  # the eager forward stays; a compiler failure is no request's fault
            self.state = "failed"
            logger.warning("compiling the one-row decode forward failed; it stays eager: %s: %s",
                           type(exc).__name__, exc)
            return
        self.compile_s = time.perf_counter() - t0
        logger.info("compiled the one-row decode forward in %.1f s", self.compile_s)
        self.state = "trial"

    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        self.model.refresh_cached()
        return self.model(ForwardContext(batch=fb, backend=self.backend, pool=self.pool, decoder=self.graph))

    # ---- use ----
    @staticmethod
    def eligible(fb: ForwardBatch) -> bool:
        return fb.batch_size == 1 and fb.num_tokens == 1

    def wants(self, fb: ForwardBatch) -> bool:
        """Whether this forward should run compiled (during the trial: every other one)."""
        if self.state == "waiting" and fb.batch_size == 1:
            self.single_seen += 1
            if self.single_seen >= START_AFTER:
                self.state = "compiling"
                self.thread = threading.Thread(target=self._compile, name="stemma-compile", daemon=True)
                self.thread.start()
        if not self.eligible(fb):
            return False
        if self.state == "trial":
            return self.trial.compiled_next()
        return self.state == "kept"

    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """The logits of a forward that `wants` compiled, or None when the graph failed (the
        caller then runs it eager; the graph is not tried again)."""
        t0 = time.perf_counter()
        try:
            logits = self._run(fb)
        except Exception as exc:
            self.state = "failed"
            logger.warning("the compiled decode forward failed; eager from now on: %s: %s",
                           type(exc).__name__, exc)
            return None
        self.calls += 1
        self.timed(True, time.perf_counter() - t0)
        return logits

    def timed(self, compiled: bool, seconds: float) -> None:
        """A trial forward's time; once the trial has its verdict, the faster kind is kept."""
        if self.state != "trial":
            return
        self.trial.record(compiled, seconds)
        verdict = self.trial.verdict()
        if verdict is not None:
            self.state = "kept" if verdict else "dropped"
            logger.info("one-row decode forward: compiled %.1f ms, eager %.1f ms: %s kept",
                        self.trial.median_ms(True), self.trial.median_ms(False),
                        "compiled" if verdict else "eager")

    def stats(self) -> dict:
        return {"state": self.state, "compile_s": self.compile_s,
                "compiled_ms": self.trial.median_ms(True), "eager_ms": self.trial.median_ms(False)}
