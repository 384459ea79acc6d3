"""What a step costs on this machine, measured: a linear fit of decode-only step times,

    seconds ~ a + b * rows + c * draft_rows + d * speculating_requests + e * compiled,

by least squares over the recent steps (exponential forgetting), pulled towards a prior that is
itself measured: until the fit has data, an extra draft row costs what a decode row costs, and
a decode row is PRIOR_ROW_SHARE of a step (ridge weight PRIOR_WEIGHT, in steps, on the four
slopes; the intercept is the data's). Where the data do not vary (every step one row, no drafts
yet), the prior decides the slope; once they vary, the data do.

`compiled` marks a plain step that a compiled decode graph ran (verify steps run eager). Those
steps are fitted too: without them the fit never starts where every plain step runs compiled
(`compile_decode=on`), and learns nothing more wherever the compiled plain step wins.
"""
from __future__ import annotations

import numpy as np

FORGET = 0.995         # weight of a step 1/(1-FORGET) = 200 steps later
PRIOR_WEIGHT = 4.0
PRIOR_ROW_SHARE = 0.03  # ~1 ms of a 30 ms batch-1 step, as measured on the default model


class StepCost:
    def __init__(self):
        self.xtx = np.zeros((5, 5))
        self.xty = np.zeros(5)
        self.steps = 0
        self.mean = 0.0            # forgetting mean of the observed step times
        self._coef: np.ndarray | None = None

    def observe(self, rows: int, draft_rows: int, speculating: int, seconds: float,
                compiled: bool = False) -> None:
        x = np.array([1.0, rows, draft_rows, speculating, float(compiled)])
        self.xtx = FORGET * self.xtx + np.outer(x, x)
        self.xty = FORGET * self.xty + x * seconds
        self.steps += 1
        self.mean = seconds if self.steps == 1 else FORGET * self.mean + (1 - FORGET) * seconds
        self._coef = None

    def coef(self) -> np.ndarray:
        if self._coef is None:
            row = PRIOR_ROW_SHARE * self.mean
            prior = np.array([self.mean, row, row, 0.0, 0.0])
            ridge = PRIOR_WEIGHT * np.diag([1e-6, 1.0, 1.0, 1.0, 1.0])  # the intercept: data alone
            self._coef = np.linalg.solve(self.xtx + ridge, self.xty + ridge @ prior)
        return self._coef

    def predict(self, rows: int, draft_rows: int, speculating: int, compiled: bool = False) -> float:
        a, b, c, d, e = self.coef()
        return a + b * rows + c * draft_rows + d * speculating + e * compiled

    def extra(self, rows: int, draft_rows: int, speculating: int) -> float:
        """Seconds the draft rows add to a step of `rows` decodes (never below zero)."""
        return max(self.predict(rows, draft_rows, speculating) - self.predict(rows, 0, 0), 0.0)
