"""The matrices of a model: `Linear` layers and the token `Embedding`, each over one weight store
(stemma.models.weights: dense, int8 or int4) chosen when the model is loaded.

Both start with a dense parameter named `weight`, as torch's own modules do, so checkpoints load
by name; `use_store` then swaps in the store the loader chose. A tied output matrix is the
embedding itself (`Embedding.matmul`), so the matrix is held once, quantized or not.

Which kernel a matrix runs for a batch of `rows` rows is its `kernels` (a `KernelChoice`), set
from the dispatch table the engine measures at first load on the machine (stemma.executor.tuning);
until then every dense matrix uses F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stemma.models.weights import DenseWeight, WeightStore


@dataclass(frozen=True)
class KernelChoice:
    """`kernels[i]` serves batches of up to `max_rows[i]` rows (the last one, any larger batch)."""
    max_rows: tuple[int, ...]
    kernels: tuple[str, ...]

    def __post_init__(self):
        if not self.kernels or len(self.max_rows) != len(self.kernels) or list(self.max_rows) != sorted(self.max_rows):
            raise ValueError(f"bad kernel choice {self}")

    @classmethod
    def single(cls, kernel: str) -> KernelChoice:
        return cls((1,), (kernel,))

    def pick(self, rows: int) -> str:
        for max_rows, kernel in zip(self.max_rows, self.kernels):  # a loop a compiler can trace
            if rows <= max_rows:
                return kernel
        return self.kernels[-1]


DEFAULT_KERNELS = {"dense": KernelChoice.single("linear"), "int8": KernelChoice.single("int8"),
                   "int4": KernelChoice.single("int4")}


class Matrix(nn.Module):
    """A weight matrix [out, in] and the store that holds it."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.store: WeightStore | None = None   # None: dense, over `weight`
        self.kernels: KernelChoice | None = None  # None: the store kind's default

    def use_store(self, store: WeightStore) -> None:
        """Holds the matrix in `store` from now on; a quantized store replaces the dense weight."""
        if tuple(store.shape) != tuple(self.weight.shape):
            raise ValueError(f"store of shape {store.shape} for a matrix of {tuple(self.weight.shape)}")
        self.store = store
        if not isinstance(store, DenseWeight):
            del self.weight
            self.register_parameter("weight", None)

    def set_kernels(self, kernels: KernelChoice | None) -> None:
        """Runs `kernels` from now on (None: the store's default); a dense store drops the copy of
        the matrix those kernels never read (an embedding keeps its dense rows)."""
        self.kernels = kernels
        store = self.weights()
        if isinstance(store, DenseWeight):
            used = set((kernels or DEFAULT_KERNELS[store.kind]).kernels)
            store.settle(used, keep_dense=isinstance(self, Embedding))
            if store.weight is None and self.weight is not None:
                del self.weight
                self.register_parameter("weight", None)

    def weights(self) -> WeightStore:
        if self.store is None:
            self.store = DenseWeight(self.weight)
        return self.store

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T; on CPU a dense `mm_t` result is a transposed view."""
        store = self.weights()
        kernels = self.kernels or DEFAULT_KERNELS[store.kind]
        return store.matmul(x, kernels.pick(x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]))


class Linear(Matrix):
    """y = x W^T + b, with parameters named as torch.nn.Linear's. A row-parallel one
    (`reduce`, a models.parallel.TensorParallel) adds its bias to its rank's partial product,
    then sums the ranks' (only rank 0 holds the bias non-zero): every rank gets the same y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reduce = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.bias is not None:
            y = y + self.bias
        return y if self.reduce is None else self.reduce.all_reduce(y)


class Embedding(Matrix):
    """Token embeddings [vocab, hidden]: rows looked up from the store (dequantized rows when it
    is quantized); `matmul` makes it the tied output matrix."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.vocab = None  # vocab-parallel: (first token id held here, its TensorParallel)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return self.weights().rows(input_ids)
        first, tp = self.vocab
        store = self.weights()
        local = input_ids - first
        held = (local >= 0) & (local < store.shape[0])
        rows = store.rows(local.clamp(0, store.shape[0] - 1))
        return tp.all_reduce(rows * held[:, None].to(rows.dtype))  # each token from its rank
