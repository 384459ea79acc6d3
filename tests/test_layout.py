"""The package layout: the client and the frontend load without torch, `import stemma` changes no
environment variable, and the import contracts in pyproject.toml ([tool.importlinter]) hold."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> None:
    """Runs `code` in a fresh interpreter (so nothing this test process imported counts)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_client_and_frontend_load_without_torch():
    _python(
        "import os, sys\n"
        "import stemma\n"
        "env = dict(os.environ)\n"
        "stemma.connect\n"
        "import stemma.lang\n"
        "assert 'torch' not in sys.modules, 'stemma.connect / stemma.lang imported torch'\n"
        "assert dict(os.environ) == env, 'stemma.connect / stemma.lang changed os.environ'\n")


def test_import_stemma_leaves_environ_unchanged():
    _python(
        "import os\n"
        "env = dict(os.environ)\n"
        "import stemma\n"
        "assert dict(os.environ) == env, 'import stemma changed os.environ'\n")


def _lint_imports() -> str | None:
    beside = Path(sys.executable).parent / "lint-imports"
    return str(beside) if beside.is_file() else shutil.which("lint-imports")


def test_import_contracts_hold():
    exe = _lint_imports()
    if exe is None:
        pytest.skip("lint-imports (PyPI import-linter, in the test extra) is not installed")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
