"""`x @ weight^T` shaped for the few rows of a decode step on CPU.

With the default model (bf16, 2 cores), oneDNN multiplies `weight @ x^T` much faster than
`linear(x, weight)` when x has 2-32 rows: the 262k x 640 output matrix took 16-18 ms against
27-30 ms for 2-16 rows, and the 4096 x 640 gate/up projection 0.24 against 0.33 ms. One row
takes the matrix-vector path either way (26 ms for the output matrix), so it is padded to two.
The result is a transposed view ([rows, out] with strides (1, rows)); the next matmul reads it
without a copy. Past 32 rows, and off the CPU, this is `torch.nn.functional.linear`.
"""
from __future__ import annotations

import torch
from torch import nn

SMALL_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or not 0 < rows <= SMALL_ROWS:
        return nn.functional.linear(x, weight, bias)
    xt = torch.cat([x, x]).t() if rows == 1 else x.t()
    y = torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)
    return y[:, :rows].t()


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
