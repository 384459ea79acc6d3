"""Registries: names known without importing their modules, bound by the implementing module."""
import subprocess
import sys

import pytest

from stemma.registry import ATTENTION_BACKENDS, MODEL_FAMILIES, POLICIES, Registry


def test_names_are_known_without_importing_the_implementations():
    code = ("import sys; from stemma.registry import ATTENTION_BACKENDS, POLICIES, MODEL_FAMILIES\n"
            "assert ATTENTION_BACKENDS.names() == ('torch', 'triton')\n"
            "assert 'lpm' in POLICIES and 'gemma3' in MODEL_FAMILIES\n"
            "assert 'torch' not in sys.modules and 'stemma.engine.policy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_get_imports_the_declared_module_and_returns_what_it_registered():
    from stemma.attention.torch_backend import TorchAttentionBackend
    from stemma.models.gemma3 import Gemma3ForCausalLM
    assert ATTENTION_BACKENDS.get("torch") is TorchAttentionBackend
    assert MODEL_FAMILIES.get("gemma3") is Gemma3ForCausalLM
    assert callable(POLICIES.get("sjf"))
    with pytest.raises(ValueError, match="schedule_policy must be one of fcfs, lpm, dfs-weight, sjf"):
        POLICIES.get("random")


def test_register_checks_the_declaration():
    reg = Registry("thing", {"a": __name__, "b": "elsewhere.module"})

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a
    with pytest.raises(LookupError, match="registered twice"):
        reg.register("a")(a)
    with pytest.raises(LookupError, match="not declared"):
        reg.register("b")(a)
    with pytest.raises(LookupError, match="not declared"):
        reg.register("c")(a)
