"""The dispatch table: which kernel each of the model's matrices runs for a batch of R rows,
measured on this machine at the model's first load and cached.

A kernel that was fastest on one CPU can be the slowest on the next (oneDNN's `F.linear` against
`W @ x^T` flipped between two machines of this project; oneDNN's prepacked `packed` needs the
CPU's bf16 instructions to pay), so nothing here is a constant: for every
distinct (store, out, in) of the model, each kernel the store offers is timed at ROW_COUNTS rows
in the model dtype (timing the model's own store of that shape), and the fastest serves row
counts up to that one. `stemma tune --show`
prints the table; `--all` also times the stores the model does not use (int8 and int4 for a
dense matrix, ...), to see what quantizing would buy.

The table is cached under <cache root>/tune/, keyed by CPU model, torch version, thread count,
dtype and shapes; later loads reuse it. STEMMA_AUTOTUNE=0 skips measuring (every matrix keeps
its store's default kernel): the test suite sets it, so that its many tiny models do not each
pay for a measurement.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stemma.models.linear import KernelChoice
from stemma.models.weights import DenseWeight, Int4Weight, Int8Weight
from stemma.paths import cache_root
from stemma.progress import stage

if TYPE_CHECKING:
    from stemma.models.causal_lm import CausalLM
    from stemma.models.weights import WeightStore

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
TABLE_FORMAT = 2  # 2: dense matrices may run `packed`
MIN_TIME_S = 0.01  # per kernel and row count, after one warm-up call
AUTOTUNE_ENV = "STEMMA_AUTOTUNE"


@dataclass
class Entry:
    kind: str                  # the store the model holds this shape in
    out_features: int
    in_features: int
    times_ms: dict[str, list[float]] = field(default_factory=dict)  # kernel -> ms at ROW_COUNTS
    choice: list[str] = field(default_factory=list)                 # the kernel at each row count

    @property
    def shape(self) -> tuple[str, int, int]:
        return (self.kind, self.out_features, self.in_features)

    def kernels(self) -> KernelChoice:
        return KernelChoice(ROW_COUNTS, tuple(self.choice))


@dataclass
class DispatchTable:
    cpu: str
    torch_version: str
    threads: int
    dtype: str
    entries: list[Entry]
    seconds: float = 0.0       # how long measuring took
    format: int = TABLE_FORMAT

    def for_shape(self, kind: str, out_features: int, in_features: int) -> KernelChoice | None:
        for e in self.entries:
            if e.shape == (kind, out_features, in_features):
                return e.kernels()
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> DispatchTable:
        data = json.loads(text)
        data["entries"] = [Entry(**e) for e in data["entries"]]
        for entry in data["entries"]:  # a damaged entry raises here (ValueError), not at apply()
            entry.kernels()
            if any(kernel not in entry.times_ms for kernel in entry.choice):
                raise ValueError(f"entry {entry.shape} chooses a kernel it did not measure")
        return cls(**data)

    def show(self) -> str:
        """The table as text: per shape, each kernel's time at each row count, the chosen one starred."""
        lines = [f"dispatch table: {self.cpu}, torch {self.torch_version}, {self.threads} threads, "
                 f"{self.dtype} (measured in {self.seconds:.1f} s)",
                 f"{'store':>6} {'out x in':>14} {'kernel':>7} " + " ".join(f"{r:>8}" for r in ROW_COUNTS)]
        for e in self.entries:
            for kernel, times in e.times_ms.items():
                cells = [f"{t:7.3f}{'*' if e.choice[i] == kernel else ' '}" for i, t in enumerate(times)]
                lines.append(f"{e.kind:>6} {e.out_features:>7}x{e.in_features:<6} {kernel:>7} " + " ".join(cells))
        lines.append("ms per call at each row count; * = the kernel used")
        return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


Shape = tuple[str, int, int]  # (store kind, out, in)


def stores_of(model: CausalLM) -> dict[Shape, WeightStore]:
    """One of the model's own stores for each distinct (store kind, out, in) of its matrices."""
    stores: dict[Shape, WeightStore] = {}
    for matrix in model.matrices().values():
        store = matrix.weights()
        stores.setdefault((store.kind, *store.shape), store)
    return stores


def table_path(shapes: list[Shape], dtype: torch.dtype, all_stores: bool) -> Path:
    identity = json.dumps([TABLE_FORMAT, cpu_name(), torch.__version__, torch.get_num_threads(),
                           str(dtype), shapes, all_stores])
    return cache_root() / "tune" / f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"


def _time_ms(store: WeightStore, kernel: str, x: torch.Tensor) -> float:
    store.matmul(x, kernel)
    n, start = 0, time.perf_counter()
    while n < 2 or time.perf_counter() - start < MIN_TIME_S:
        store.matmul(x, kernel)
        n += 1
    return (time.perf_counter() - start) / n * 1000.0


def _others(store: WeightStore, dtype: torch.dtype) -> list[WeightStore]:
    """The same matrix in the stores the model does not use (int4 in groups of 64 where its
    kernel takes the shape), for `--all`."""
    weight = store.dequantize()
    others: list[WeightStore] = []
    if store.kind != "dense":
        others.append(DenseWeight(weight.to(dtype)))
    if store.kind != "int8":
        others.append(Int8Weight.quantize(weight, dtype))
    if store.kind != "int4" and Int4Weight.supports(weight, 64):
        others.append(Int4Weight.quantize(weight, dtype, 64))
    return others


@torch.inference_mode()
def measure(stores: dict[Shape, WeightStore], dtype: torch.dtype, all_stores: bool = False) -> DispatchTable:
    """Times each kernel of each store (the model's own; with all_stores, the others too) at
    ROW_COUNTS rows; each matrix gets the fastest of its own store's kernels per row count."""
    start = time.perf_counter()
    entries = []
    for (kind, out, k), store in stores.items():
        entry = Entry(kind, out, k)
        for timed in [store, *(_others(store, dtype) if all_stores else [])]:
            for kernel in timed.kernels:
                try:
                    entry.times_ms[kernel] = [
                        _time_ms(timed, kernel, torch.randn(r, k).to(dtype)) for r in ROW_COUNTS]
                except RuntimeError as exc:  # a kernel this CPU cannot run is not a choice
                    logger.info("kernel %s cannot run a %dx%d %s matrix here: %s", kernel, out, k, kind, exc)
        usable = [kn for kn in store.kernels if kn in entry.times_ms]
        entry.choice = [min(usable, key=lambda kn: entry.times_ms[kn][i]) for i in range(len(ROW_COUNTS))]
        entries.append(entry)
    return DispatchTable(cpu_name(), torch.__version__, torch.get_num_threads(), str(dtype), entries,
                         time.perf_counter() - start)


def load_or_measure(model: CausalLM, dtype: torch.dtype, all_stores: bool = False,
                    remeasure: bool = False) -> DispatchTable:
    """The cached table for this model's shapes on this machine, measured (and cached) if absent."""
    stores = stores_of(model)
    path = table_path(list(stores), dtype, all_stores)
    if path.is_file() and not remeasure:
        try:
            return DispatchTable.from_json(path.read_text())
        except (ValueError, TypeError, KeyError) as exc:  # a damaged entry is measured again
            logger.warning("ignoring the unreadable dispatch table %s: %s", path, exc)
    stage(logger, "measuring the kernel dispatch table of %d matrix shapes on this CPU (once; a few seconds)",
          len(stores))
    table = measure(stores, dtype, all_stores)
    logger.info("measured the kernel dispatch table in %.1f s (%d shapes); cached at %s",
                table.seconds, len(stores), path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(table.to_json())
    staging.replace(path)
    return table


def apply(model: CausalLM, table: DispatchTable) -> None:
    """Sets every matrix's kernel choice from `table`."""
    for matrix in model.matrices().values():
        store = matrix.weights()
        matrix.set_kernels(table.for_shape(store.kind, *store.shape))


def model_dtype(model: CausalLM) -> torch.dtype:
    """The activation dtype: the model's parameters' (norms and dense matrices)."""
    return next(model.parameters()).dtype


def tune(model: CausalLM) -> DispatchTable | None:
    """At load: the table for this model on this CPU (None when STEMMA_AUTOTUNE=0 or off the CPU),
    applied to the model."""
    if os.environ.get(AUTOTUNE_ENV, "1") == "0" or next(model.parameters()).device.type != "cpu":
        return None
    table = load_or_measure(model, model_dtype(model))
    apply(model, table)
    return table
