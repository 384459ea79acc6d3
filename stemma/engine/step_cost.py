"""What an engine step costs on this machine, learned online from the engine's own steps.

    seconds ~ a + b * decode_rows + c * prefill_tokens + d * attention

`decode_rows` counts one row per decoding request (plus its draft rows when it speculates),
`prefill_tokens` the prompt (or forced) tokens extended this step, and `attention` the keys the
step's queries read, in thousands: a decode row at sequence length L reads L, a prefill chunk of
n tokens after a prefix p reads n * (p + n / 2). The fit is least squares over the last WINDOW
steps, non-negative (scipy's nnls: a step never gets cheaper with more work), with a small
ridge towards zero slopes so that a feature the data have not varied yet does not swing the fit.

It is seeded by a short warm-up of synthetic forwards (`Engine.warm_up_step_cost`) and then
updated by every step's measured wall time (schedule, forward, sampling and booking: what a
streaming client sees between two tokens). `error()` is the median absolute relative error of
the predictions made for the last steps before they ran.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.optimize import nnls

if TYPE_CHECKING:
    from stemma.engine.plan import StepPlan

WINDOW = 512          # steps in the fit
MIN_STEPS = 4         # fewer: no prediction (None)
RIDGE = 1e-5          # on the slopes, relative to the data's scale
REFIT_EVERY = 8       # steps between two fits
MARGIN_QUANTILE = 0.995  # a target is held for this share of steps (beyond the p99 of inter-token gaps)
MAX_MARGIN = 0.5


@dataclass
class StepShape:
    """The work of one step, as the cost model reads it."""
    decode_rows: int = 0
    prefill_tokens: int = 0
    attention: float = 0.0   # thousands of key reads

    def decode(self, seq_len: int, rows: int = 1) -> None:
        self.decode_rows += rows
        self.attention += rows * seq_len / 1000.0

    def prefill(self, n: int, prefix: int) -> None:
        self.prefill_tokens += n
        self.attention += n * (prefix + n / 2.0) / 1000.0

    def features(self) -> np.ndarray:
        return np.array([1.0, self.decode_rows, self.prefill_tokens, self.attention])

    def copy(self) -> StepShape:
        return StepShape(self.decode_rows, self.prefill_tokens, self.attention)

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        shape = cls()
        for i, (req, n) in enumerate(zip(plan.reqs, plan.counts)):
            if i < plan.decodes:
                shape.decode(req.kv_len + n, rows=n)
            else:
                shape.prefill(n, req.kv_len)
        return shape


class StepCost:
    def __init__(self):
        self.samples: deque[tuple[np.ndarray, float]] = deque(maxlen=WINDOW)
        self.errors: deque[float] = deque(maxlen=WINDOW)   # |predicted - actual| / actual
        self.overruns: deque[float] = deque(maxlen=WINDOW)  # actual / predicted - 1
        self.last: tuple[float, float] | None = None          # (predicted, actual) of the last step
        self.coef: np.ndarray | None = None
        self._since_fit = 0

    def observe(self, shape: StepShape, seconds: float, predicted: float | None = None) -> None:
        """A step's measured time; `predicted` is what `predict` said for it before it ran."""
        if predicted is not None and seconds > 0:
            self.errors.append(abs(predicted - seconds) / seconds)
            if predicted > 0:
                self.overruns.append(seconds / predicted - 1.0)
            self.last = (predicted, seconds)
        self.samples.append((shape.features(), seconds))
        self._since_fit += 1
        if self.coef is None or self._since_fit >= REFIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        if len(self.samples) < MIN_STEPS:
            self.coef = None
            return
        x = np.stack([f for f, _ in self.samples])
        y = np.array([s for _, s in self.samples])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-9)    # columns to [0, 1]: one ridge fits all
        ridge = np.sqrt(RIDGE * len(y)) * np.diag([0.0, 1.0, 1.0, 1.0])[1:]
        coef, _ = nnls(np.vstack([x / scale, ridge]), np.concatenate([y, np.zeros(3)]))
        self.coef = coef / scale

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def predict(self, shape: StepShape) -> float | None:
        if self.coef is None:
            return None
        return float(max(shape.features() @ self.coef, 0.0))

    def margin(self) -> float:
        """How far a step runs past its prediction at the MARGIN_QUANTILE of recent steps
        (clipped to [0, MAX_MARGIN]): the headroom a target needs to hold for nearly every step."""
        if len(self.overruns) < MIN_STEPS:
            return 0.0
        q = float(np.quantile(np.fromiter(self.overruns, float), MARGIN_QUANTILE))
        return min(max(q, 0.0), MAX_MARGIN)

    def error(self) -> float | None:
        return statistics.median(self.errors) if self.errors else None

    def stats(self) -> dict:
        out: dict = {"steps": len(self.samples), "median_abs_error": self.error(), "margin": self.margin()}
        if self.coef is not None:
            a, b, c, d = (float(v) for v in self.coef)
            out.update(base_ms=1e3 * a, per_decode_row_ms=1e3 * b, per_prefill_token_ms=1e3 * c,
                       per_1k_keys_ms=1e3 * d)
        if self.last is not None:
            out.update(last_predicted_ms=1e3 * self.last[0], last_actual_ms=1e3 * self.last[1])
        return out
