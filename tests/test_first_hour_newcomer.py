"""scripts/newcomer.sh in CI, with a time limit: a fresh clone of this repository runs the
README's first command, one example, one CLI call and one REPL line on the default model. It
reuses this test run's environment (NEWCOMER_VENV) rather than installing torch again; the
script checks that the clone's own code is what runs."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 420  # four model loads and three short runs take about a minute on 2 cores


def test_newcomer_script_passes_from_a_fresh_clone():
    if shutil.which("git") is None or shutil.which("script") is None:
        pytest.skip("the newcomer script needs git and script (util-linux)")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: there is nothing to clone")
    env = {**os.environ, "NEWCOMER_VENV": sys.prefix, "NEWCOMER_STEP_TIMEOUT": "240"}
    env.pop("PYTHONPATH", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "newcomer.sh"), str(ROOT)], env=env,
                          capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "newcomer: all steps passed" in proc.stdout
    assert time.monotonic() - start < LIMIT_S
