"""Small helpers shared by the benchmark scripts."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def timed(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """Median wall time of fn() in seconds, after warm-up calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class CpuAudit:
    """CPU time the machine spent outside this process tree while a block ran (Linux /proc only;
    elsewhere every figure is nan). A benchmark on a shared machine can flag rounds that others
    disturbed: `with CpuAudit() as a: ...; a.foreign_cores` (average cores used by others).

    `bystanders`: pids of this tree whose own trees count as others' too: the server that is not
    being measured (a background compile in it takes the cores from the one that is)."""

    def __init__(self, bystanders: tuple[int, ...] = ()):
        self.bystanders = tuple(bystanders)

    def __enter__(self) -> "CpuAudit":
        self._t0, self._busy0, self._ours0 = time.perf_counter(), _machine_busy(), self._ours()
        return self

    def _ours(self) -> float:
        return _tree_cpu(skip=self.bystanders)

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t0
        busy, ours = _machine_busy() - self._busy0, self._ours() - self._ours0
        self.busy_cores = busy / self.wall
        self.ours_cores = ours / self.wall
        self.foreign_cores = max(0.0, busy - ours) / self.wall


def _clock_ticks() -> float:
    import os
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


def _machine_busy() -> float:
    """Seconds of CPU time (all cores, not idle or iowait) since boot; nan without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    return (sum(fields[:8]) - fields[3] - fields[4]) / _clock_ticks()


def _tree_cpu(skip: tuple[int, ...] = ()) -> float:
    """Seconds of CPU time used by this process and its descendants (live ones, and the children
    they have waited for), leaving out the descendants in `skip` and theirs; nan without /proc.
    One pass over /proc: every figure is from the same moment."""
    import os
    try:
        parents, cpu = {}, {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(name)] = int(rest[1])
            cpu[int(name)] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
    except OSError:
        return float("nan")
    ours, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in ours and child not in skip:
                ours.add(child)
                frontier.append(child)
    return sum(cpu.get(p, 0) for p in ours) / _clock_ticks()
