"""benchmarks/common.py's CpuAudit: a server that is not being measured counts as another process."""
import subprocess
import sys
import time

import pytest

from tests.test_latency_options import _benchmark

common = _benchmark("common")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_bystander_child_counts_as_another_process():
    # a child of this process (as the benchmark's servers are) spins one core; the same interval
    # audited both ways differs by that core
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        time.sleep(0.3)  # the interpreter has started
        with common.CpuAudit() as blind, common.CpuAudit(bystanders=(child.pid,)) as seen:
            time.sleep(1.5)
        assert seen.foreign_cores - blind.foreign_cores > 0.5, (seen.foreign_cores, blind.foreign_cores)
        assert seen.ours_cores < 0.5 <= blind.ours_cores
    finally:
        child.kill()
        child.wait()
