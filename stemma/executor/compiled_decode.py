"""The decode forward compiled by Inductor (`torch.compile`), beside the eager one.

A decode step on CPU reads every weight once, and in eager mode a third of it more went to
dispatching some 2,500 small ops: norms, casts, rope, the KV write and the attention glue between
the matmuls. Inductor fuses that glue into a few C++ loops per layer; the matmuls stay the kernels
the dispatch table chose (packed ones through the `stemma::packed_linear` op).

What runs compiled: forwards in which every request decodes one token (no prefill, no draft to
verify); the decoder layers and the final norm (the embedding and the output matrix stay eager).
One graph serves one *bucket* of batch sizes: a single request (Dynamo specializes a size of 1),
then each range of rows between two cuts of the layers' dispatch tables, since the graph traces
each matrix's kernel choice by row count (`KernelChoice.pick`). Within a bucket the batch size and
the context length are dynamic dimensions, and nothing in the graph may guard on the context's
length (see `attention.torch_backend.attend`): a guard that fails recompiles inside a step. Every
other forward runs eager.

Modes (`EngineConfig.compile_decode`):
- `on`: the one-request graph is compiled in the constructor, each other bucket's in the step
  that first meets it; all are used from then on.
- `auto` (CPU only; `STEMMA_COMPILE=0` makes it `off`, as the test suite does): once the engine
  has run START_AFTER decode forwards (forwards in which every request decodes or verifies its
  drafts: a one-off command that decodes a few dozen tokens never pays for it), each bucket a
  decode forward falls in is compiled on a background thread, one at a time (15-30 s each on
  2 cores; Inductor's on-disk cache shortens later starts), while its forwards run eager. The
  thread's Python waits while any forward runs (`executor.compile_gate`: it holds the GIL that
  every eager op takes back) and the compiler processes it starts run at the lowest CPU
  priority, so it compiles in the engine's idle time; under a load that never lets up, the
  engine stays eager. Then
  the next TRIALS forwards of that bucket alternate, and its graph is kept only if its median
  forward is faster than eager: measured on the machine, bucket by bucket.
- `off`: eager only.
The same thread first compiles the row ops of the eager forwards (`executor.compiled_rows`: the
norms, rope and activation as one loop each, which a prefill of many rows gains most from; `on`:
in the constructor) and times them against the eager ones; a measured row count decides which
forwards use them.
A compile that raises leaves its bucket eager; a compiled call that raises, every bucket (logged).

Invariants: the graphs run on their own attention backend (per-forward metadata lives on a
backend, and the compile thread must not touch the one the steps use); a compile holds it
(`busy`), and a step that finds it held runs eager. A compile's dummy forward
writes only KV slot 0, the padding slot that no request holds. A graph makes the norm scales
that eager forwards cache (`RMSNorm.scale`) from the weights it reads at each call, so a weight
changed in place or replaced is seen at once. A step calls the graph only for a bucket whose compile
has finished, so a step never compiles in `auto`.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import math
import os
import statistics
import sys
import threading
import time
from types import FunctionType, MethodType

import torch
from torch.fx.experimental import _config as fx_config

from stemma.attention.select import make_attention_backend
from stemma.executor.compile_gate import GATE
from stemma.executor.compiled_rows import CompiledRows
from stemma.executor.trace_guard import compile_job, forwarding, install
from stemma.gc_pauses import GC_PAUSES
from stemma.cache.kv_pool import KVPool
from stemma.executor.forward_batch import ForwardBatch
from stemma.models.causal_lm import CausalLM
from stemma.models.layers import ForwardContext
from stemma.models.row_ops import RowOps

logger = logging.getLogger(__name__)

COMPILE_ENV = "STEMMA_COMPILE"
START_AFTER = 128    # decode forwards before auto starts compiling
TRIALS = 8          # timed forwards of each kind before auto keeps or drops the graph
DUMMY_CONTEXT = 16  # the compile's dummy requests attend to this many (padding) slots + rows + themselves
COMPILE_SWITCH_INTERVAL = 1e-4  # seconds: the GIL switch interval while a background compile runs
COMPILE_NICE = 19   # the background compile thread's nice value (Linux: per thread): the lowest
ONE = -1            # the bucket of a single request; the others are 0, 1, ... (`CompiledDecode.bucket`)
ROWS = -2           # the queue's mark for the row ops' compile (executor.compiled_rows), no bucket


class _ShortSwitch:
    """The GIL's switch interval, short while any compile thread of the process lives.

    Tracing is Python that holds the GIL, and every op of an eager step released and must take
    it back: at the default 5 ms interval a step stalled for seconds while a compile ran. The
    interval in force before the first of overlapping compile threads is restored after the
    last (engines compile on threads of their own)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.threads = 0
        self.saved = 0.0

    def __enter__(self) -> None:
        with self.lock:
            if self.threads == 0:
                self.saved = sys.getswitchinterval()
                sys.setswitchinterval(COMPILE_SWITCH_INTERVAL)
            self.threads += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.threads -= 1
            if self.threads == 0:
                sys.setswitchinterval(self.saved)


_SHORT_SWITCH = _ShortSwitch()


def _lowest_priority() -> None:
    """This thread, and the compiler processes it starts, take only the CPU that the steps leave
    idle. The compiler processes hold no GIL, so the compile gate does not hold them back; at
    the default priority they took a core from the steps (benchmarks/compile_load.py)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: the compile goes on
        logger.debug("the compile thread keeps its priority: %s", exc)


def _decodes_only(fb: ForwardBatch) -> bool:
    """Whether every request of the forward decodes: one new token, or a verify of its drafts
    (logits at each new token); a prefill chunk asks the logits of its last token only."""
    return all(c == e for c, e in zip(fb.logits_counts, fb.extend_lens_cpu))


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


def row_cuts(model: CausalLM) -> tuple[int, ...]:
    """Every row count at which some layer matrix's kernel choice changes (the graph traces them)."""
    cuts = {1}
    for name, matrix in model.matrices().items():
        if name.startswith("model.layers.") and matrix.kernels is not None:
            cuts.update(matrix.kernels.max_rows)
    return tuple(sorted(cuts))


class CompiledDecode:
    def __init__(self, model: CausalLM, pool: KVPool, mode: str):
        self.model = model
        self.pool = pool
        self.mode = mode
        self.backend = make_attention_backend("torch", "cpu", model.spec.layer_windows)
        for matrix in model.matrices().values():  # stores are made on first use: here, not in a trace
            matrix.weights()
        self.cuts = row_cuts(model)
        # one graph per bucket, the one-request graph included: each a recompile of the same code.
        # The limit goes with the function: dynamo's config is per thread (a context variable), and
        # the compiles run on their own thread. Guards on the modules' attributes cost ~1 ms a
        # call; this graph serves one model only.
        self.graph = torch.compile(_own_code(model.decode_rows), dynamic=True, fullgraph=True,
                                   recompile_limit=len(self.cuts) + 2,
                                   options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.started = False       # (auto) START_AFTER decode forwards seen
        self.failed = False
        self.decodes_seen = 0      # decode forwards before the start
        self.compiles: dict[int, str] = {}    # bucket -> queued | compiling | ready | failed
        self.queue: list[int] = []            # buckets waiting for the compile thread
        self.trials: dict[int, Trial] = {}
        self.verdicts: dict[int, bool] = {}   # bucket -> whether its graph is kept (its trial over)
        self.compile_s: float | None = None   # all compiles so far, summed
        self.compiles_started = 0  # a step in which this changed held a compile (`on`: compiled in the step)
        self.calls = 0             # forwards the graphs served
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()          # queue and thread
        self.busy = threading.Lock()          # held by a compile: the graphs' backend is in use
        self.rows = CompiledRows(self._run_rows, self.cuts)  # the eager forwards' row ops, compiled first
        if mode == "on":
            self.started = True
            self._compile(ONE)
            self.rows.compile()

    # ---- states ----
    def bucket_state(self, bucket: int) -> str:
        """waiting (never queued), compiling (queued or compiling), trial, kept, dropped or failed."""
        status = self.compiles.get(bucket)
        if self.failed or status == "failed":
            return "failed"
        if status is None:
            return "waiting"
        if status != "ready":
            return "compiling"
        verdict = self.verdicts.get(bucket)
        return "trial" if verdict is None else "kept" if verdict else "dropped"

    @property
    def compiling(self) -> bool:
        """Whether the background thread has a compile queued or running: Dynamo's tracing then
        holds the GIL, and an eager step takes several times as long as it otherwise would."""
        return self.thread is not None

    @property
    def phase(self) -> str:
        """Where the engine's compile work stands: `counting` (auto, before START_AFTER decode
        forwards), `compiling` (a compile queued or running on the background thread), `idle`
        (none now; a bucket not met yet may still start one) or `failed`."""
        if self.failed:
            return "failed"
        if not self.started:
            return "counting"
        return "compiling" if self.compiling else "idle"

    @property
    def state(self) -> str:
        """The one-request graph's state (`batched_states()` gives the others')."""
        return self.bucket_state(ONE)

    def bucket_rows(self, bucket: int) -> tuple[int, int | None]:
        """The batch sizes of a bucket other than ONE (>= 1, as cuts[0] is 1): lo..hi (hi None: no bound)."""
        return self.cuts[bucket - 1] + 1, self.cuts[bucket] if bucket < len(self.cuts) else None

    def batched_states(self) -> dict[str, str]:
        """`lo-hi` (or `lo+`) -> state, for every bucket of several rows met so far."""
        out = {}
        for bucket in sorted(b for b in self.compiles if b != ONE):
            lo, hi = self.bucket_rows(bucket)
            out[f"{lo}-{hi}" if hi is not None else f"{lo}+"] = self.bucket_state(bucket)
        return out

    # ---- the compiles ----
    @compile_job()
    def _compile(self, bucket: int) -> None:
        """Compiles `bucket`'s graph with a dummy forward of the fewest rows it holds."""
        self.compiles_started += 1
        self.compiles[bucket] = "compiling"
        rows = 1 if bucket == ONE else self.bucket_rows(bucket)[0]
        # built outside inference mode, as the runner builds its batches: the graph's guards check
        # the tensors' dispatch keys
        with torch.inference_mode(False):  # `on` compiles inside a step's forward
            # a context longer than the batch: a dummy whose sizes coincide trips Dynamo's guards
            fb = ForwardBatch.on_padding_slot(rows, DUMMY_CONTEXT + rows)
        t0 = time.perf_counter()
        try:
            # no duck sizing: the dummy's batch size must not be tied to another size that it equals
            with self.busy, torch.inference_mode(), fx_config.patch(use_duck_shape=False):
                self._run(fb)
        except Exception as exc:  # the eager forward stays; a compiler failure is no request's fault
            self.compiles[bucket] = "failed"
            logger.warning("compiling the decode forward for %d-row batches failed; they stay eager: %s: %s",
                           rows, type(exc).__name__, exc)
            return
        seconds = time.perf_counter() - t0
        self.compile_s = (self.compile_s or 0.0) + seconds
        logger.info("compiled the decode forward for %d-row batches in %.1f s", rows, seconds)
        self.trials[bucket] = Trial()
        if self.mode == "on":
            self.verdicts[bucket] = True
        self.compiles[bucket] = "ready"

    def _request(self, bucket: int) -> None:
        """Queues `bucket`'s compile for the background thread (auto), or compiles it now (on)."""
        if self.mode == "on":
            self._compile(bucket)
            return
        with self.lock:
            self.compiles[bucket] = "queued"
            self._queue(bucket)

    def _queue(self, bucket: int) -> None:
        """Appends to the background thread's queue (ROWS: the row ops), starting the thread if
        none runs; under `lock`."""
        self.queue.append(bucket)
        if self.thread is None:
            self.thread = threading.Thread(target=self._drain, name="stemma-compile", daemon=True)
            self.thread.start()

    def _drain(self) -> None:
        _lowest_priority()
        # where the trace windows cannot patch for their own thread, a compile holds GUARD
        # throughout (trace_guard): pacing it would stall the forwards that wait for it, and the
        # row ops' trial is left to a step
        paced = install()
        # one run of compiles for stemma.gc_pauses: no settle between two of its jobs
        with _SHORT_SWITCH, GC_PAUSES.compiling(), (GATE.paced() if paced else contextlib.nullcontext()):
            while True:
                with self.lock:  # under the lock: a bucket queued after this starts the next thread
                    if self.failed or not self.queue:
                        self.thread = None
                        return
                    bucket = self.queue.pop(0)
                if bucket == ROWS:
                    self.rows.compile()  # raises nothing either
                    if self.rows.state == "ready" and paced:
                        self.rows.trial(paced=True)  # in the engine's idle time, not inside a step
                else:
                    self._compile(bucket)  # raises nothing: a failed compile marks its bucket

    def _run_rows(self, fb: ForwardBatch, ops: RowOps) -> torch.Tensor:
        """An eager forward with `ops` on the graphs' backend (the row ops' compile and trial)."""
        with self.busy, forwarding():
            return self.model(ForwardContext(batch=fb, backend=self.backend, pool=self.pool, ops=ops))

    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        with forwarding():
            return self.model(ForwardContext(batch=fb, backend=self.backend, pool=self.pool, decoder=self.graph))

    # ---- use ----
    def bucket(self, fb: ForwardBatch) -> int | None:
        """The graph that would serve this forward, when every request decodes one token; else None."""
        if fb.num_tokens != fb.batch_size:
            return None
        return self._bucket_of(fb.batch_size)

    def _bucket_of(self, rows: int) -> int:
        return ONE if rows == 1 else bisect.bisect_left(self.cuts, rows)

    def wants(self, fb: ForwardBatch) -> bool:
        """Whether this forward should run compiled (during a bucket's trial: every other one)."""
        bucket = self.bucket(fb)
        if not self.started and _decodes_only(fb):
            self._seen()  # the one count of a forward: the runner asks once per forward
        if bucket is None or not self.started or self.failed:
            return False
        if bucket not in self.compiles:
            self._request(bucket)
        if self.compiles[bucket] != "ready":
            return False
        verdict = self.verdicts.get(bucket)
        return self.trials[bucket].compiled_next() if verdict is None else verdict

    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """The logits of a forward that `wants` compiled, or None: the caller then runs it eager
        (a compile holds the graphs' backend; or the graph failed, and no graph is tried again)."""
        if not self.busy.acquire(blocking=False):
            return None
        t0 = time.perf_counter()
        try:
            logits = self._run(fb)
        except Exception as exc:
            self.failed = True
            logger.warning("the compiled decode forward failed; eager from now on: %s: %s",
                           type(exc).__name__, exc)
            return None
        finally:
            self.busy.release()
        self.calls += 1
        self.timed(fb, True, time.perf_counter() - t0)
        return logits

    def timed(self, fb: ForwardBatch, compiled: bool, seconds: float) -> None:
        """A forward's time; once a bucket's trial has its verdict, the faster kind is kept."""
        bucket = self.bucket(fb)
        if bucket is None or self.failed or self.compiles.get(bucket) != "ready" or bucket in self.verdicts:
            return
        if self.busy.locked():  # a compile shares the cores: no fair sample
            return
        trial = self.trials[bucket]
        trial.record(compiled, seconds)
        verdict = trial.verdict()
        if verdict is not None:
            self.verdicts[bucket] = verdict
            logger.info("decode forward, %s rows: compiled %.1f ms, eager %.1f ms: %s kept",
                        "1" if bucket == ONE else "-".join(map(str, self.bucket_rows(bucket))),
                        trial.median_ms(True), trial.median_ms(False), "compiled" if verdict else "eager")

    def _seen(self) -> None:
        """One decode or verify forward more toward START_AFTER."""
        if not self.started:
            self.decodes_seen += 1
            self.started = self.decodes_seen >= START_AFTER
            if self.started:  # the row ops first: every prefill gains from them
                with self.lock:
                    self.rows.state = "queued"
                    self._queue(ROWS)

    def saving(self, rows: int) -> float:
        """Seconds a plain step of `rows` decodes saves by its bucket's graph (its trial's median
        eager minus compiled forward; 0 where no graph is kept). A step of verifies is no decode
        forward, so this is also where a bucket that only ever verifies is met and queued; while
        its graph is on trial the saving is taken as unbounded, so that plain steps give the
        trial its forwards."""
        bucket = self._bucket_of(rows)
        if self.failed or not self.started:
            return 0.0
        if bucket not in self.compiles:
            self._request(bucket)
        if self.compiles[bucket] == "ready" and bucket not in self.verdicts:
            return math.inf
        if not self.verdicts.get(bucket):
            return 0.0
        eager, compiled = self.trials[bucket].median_ms(False), self.trials[bucket].median_ms(True)
        if eager is None or compiled is None:  # `on`: kept untimed
            return 0.0
        return max(0.0, (eager - compiled) / 1e3)

    def row_ops(self, rows: int) -> RowOps:
        """The row ops of an eager forward of `rows` tokens (executor.compiled_rows)."""
        return self.rows.ops_for(rows, self.compiling)

    def stats(self) -> dict:
        one = self.trials.get(ONE, Trial())
        return {"state": self.state, "compile_s": self.compile_s, "rows": self.rows.describe(),
                "compiled_ms": one.median_ms(True), "eager_ms": one.median_ms(False),
                "batched": self.batched_states()}
