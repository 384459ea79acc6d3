"""Which eager forwards use the compiled row ops (`models.row_ops`): measured on the machine.

The ops compile on `CompiledDecode`'s background thread (its first job once it starts) by eager
forwards of synthetic prefills (`ForwardBatch.on_padding_slot`: KV slot 0 only) that use them:
one at each row count where some matrix's kernel choice changes, and at each count the trial
times. A compiled function's guards hold its inputs' strides, and a matmul's output is laid out
as its kernel leaves it (`models.linear`: a transposed view at some row counts), so only the real
forward meets every layout a step will; a step then never compiles. Then the trial: synthetic
prefills of each of ROWS_TRIED row counts, eager and compiled ops alternately, REPS of each
(about 2 s on the default model, once). In `auto` the compile thread runs it right after the
compile, in the engine's idle time (`compile_gate`: a forward pauses it, and a timing during
which a forward of the process began is taken again); in `on`, and wherever the thread did not,
the first forward that finds no compile running holds it (that step is no sample of step
cost). Forwards of at least the smallest count from
which the compiled ops won at every larger count use them; if they lost at the largest, none
does.

Why by rows: a compiled call pays Dynamo's guard checks and a wrapper, some tens of
microseconds, which a one-row forward's ops do not repay; a prefill's many rows do several times over.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import torch
from torch.fx.experimental import _config as fx_config

from stemma.executor.compile_gate import GATE
from stemma.executor.forward_batch import ForwardBatch
from stemma.executor.trace_guard import compile_job
from stemma.models.row_ops import EAGER, RowOps, compiled_row_ops

logger = logging.getLogger(__name__)

ROWS_TRIED = (32, 128, 512)
REPS = 3


class CompiledRows:
    """`run(fb, ops)`: an eager forward with those row ops (on the compiles' own attention
    backend, which it holds meanwhile); `cuts`: the row counts at which some layer matrix's
    kernel choice changes (`compiled_decode.row_cuts`)."""

    def __init__(self, run: Callable[[ForwardBatch, RowOps], torch.Tensor], cuts: tuple[int, ...]):
        self.run = run
        self.warm_rows = sorted(set(ROWS_TRIED) | {c + 1 for c in cuts if c + 1 >= ROWS_TRIED[0]})
        self.state = "waiting"   # waiting | queued | compiling | ready | kept | dropped | failed
        self.ops: RowOps | None = None
        self.min_rows: int | None = None                 # kept: forwards of at least this many rows
        self.times: dict[int, tuple[float, float]] = {}  # rows -> (eager ms, compiled ms), the trial's medians
        self.trials_run = 0  # the trial runs inside a step: that step's time is no sample of its cost

    # ---- the compile (background thread, or the constructor in `on`) ----
    @compile_job()
    def compile(self) -> None:
        """Compiles the ops by using them; a failure leaves every forward eager (logged)."""
        self.state = "compiling"
        t0 = time.perf_counter()
        try:
            ops = compiled_row_ops()
            # no duck sizing: a size that equals another by chance must not be tied to it
            with fx_config.patch(use_duck_shape=False):
                for rows in self.warm_rows:
                    self._prefill(rows, ops)
        except Exception as exc:  # a compiler failure is no request's fault
            self.state = "failed"
            logger.warning("compiling the row ops failed; forwards keep the eager ones: %s: %s",
                           type(exc).__name__, exc)
            return
        self.ops = ops
        self.state = "ready"
        logger.info("compiled the row ops (norms, rope, activation) in %.1f s", time.perf_counter() - t0)

    def _prefill(self, rows: int, ops: RowOps) -> None:
        with torch.inference_mode(False):  # built as the runner builds its batches
            fb = ForwardBatch.on_padding_slot(0, 0, prefill=rows)
        with torch.inference_mode():
            self.run(fb, ops)

    # ---- use ----
    def ops_for(self, rows: int, compiling: bool) -> RowOps:
        """The ops a forward of `rows` tokens uses. The trial runs in the first call after the
        compile that finds no compile running (`compiling`: one would share the cores; and only
        the thread that calls this queues compiles, so none starts during the trial)."""
        if self.state == "ready" and not compiling:
            self.trial()
        if self.state == "kept" and rows >= self.min_rows:
            return self.ops
        return EAGER

    def trial(self, paced: bool = False) -> None:
        """`paced`: run by the compile thread, whose Python a forward pauses (compile_gate): a
        timing during which a forward of the process began is taken again."""
        self.trials_run += 1
        try:
            self._time_both(paced)
        except Exception as exc:  # a compiler or runtime failure: no request's fault
            self.fail(exc)
            return
        self.min_rows = None
        for rows in sorted(self.times, reverse=True):  # the lowest count of an unbroken run of wins
            eager, compiled = self.times[rows]
            if compiled >= eager:
                break
            self.min_rows = rows
        self.state = "kept" if self.min_rows is not None else "dropped"
        logger.info("prefill forwards, eager vs compiled row ops: %s; %s", self.describe_times(),
                    f"compiled from {self.min_rows} rows" if self.min_rows else "eager kept")

    def _time_both(self, paced: bool) -> None:
        for rows in ROWS_TRIED:
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(REPS):
                for compiled in (False, True):
                    times[compiled].append(self._timed(rows, self.ops if compiled else EAGER, paced))
            self.times[rows] = (1e3 * statistics.median(times[False]), 1e3 * statistics.median(times[True]))

    def _timed(self, rows: int, ops: RowOps, paced: bool) -> float:
        """Seconds of one synthetic prefill (`paced`: during which no forward of the process began;
        a paced thread only runs while none does, so it waits, never spins)."""
        while True:
            begun = GATE.begun
            t0 = time.perf_counter()
            self._prefill(rows, ops)
            seconds = time.perf_counter() - t0
            if not paced or GATE.begun == begun:
                return seconds

    def fail(self, exc: Exception) -> None:
        """The compiled ops raised (in the trial, or in a forward that then ran eager): every
        forward from now on uses the eager ones."""
        self.state = "failed"
        logger.warning("the compiled row ops failed; eager from now on: %s: %s", type(exc).__name__, exc)

    def describe(self) -> str:
        """The state, and for `kept` the row count from which the compiled ops run."""
        return f"kept >= {self.min_rows} rows" if self.state == "kept" else self.state

    def describe_times(self) -> str:
        return ", ".join(f"{rows} rows {e:.1f}/{c:.1f} ms" for rows, (e, c) in self.times.items())
