import os

# Triton picks interpreter or compiled mode when a kernel module is first imported, so this must
# be set before anything imports stemma.kernels. Without CUDA, kernels run under the interpreter.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# OpenMP threads that spin at barriers make torch ops ~100x slower when another process holds
# the other core (as on a 2-core CI machine running subprocess servers). Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "0")  # tests run subprocess servers beside themselves

# Each of the suite's many tiny models would otherwise measure a kernel dispatch table at first
# load (stemma.executor.tuning); tests of the tuner itself turn it back on.
os.environ.setdefault("STEMMA_AUTOTUNE", "0")
# Likewise `compile_decode="auto"` would compile every engine's one-row decode forward on a
# background thread; the tests of the compiled path turn it on (stemma.executor.compiled_decode).
os.environ.setdefault("STEMMA_COMPILE", "0")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_default_backend_left_behind():
    """set_default_backend is process-wide (as SGLang's): one test's must not reach the next."""
    yield
    from stemma.lang.context import clear_default_backend
    clear_default_backend()
