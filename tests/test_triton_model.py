"""Tiny gemma3 and llama run end to end with the Triton attention backend (under the
interpreter on CPU) give the same greedy tokens as the torch backend."""
import pytest
import torch

pytest.importorskip("triton")

from stemma.executor.runner import ModelRunner, RunnerConfig  # noqa: E402
from stemma.loader.model import load_model  # noqa: E402
from tests.driver import Driver  # noqa: E402
from tests.tiny_models import build_tiny  # noqa: E402


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_triton_backend_greedy_matches_torch(arch, tmp_path):
    loaded = load_model(build_tiny(arch, tmp_path), dtype="float32")
    results, all_logits = {}, {}
    for backend in ("torch", "triton"):
        d = Driver(ModelRunner(loaded, RunnerConfig(kv_pool_tokens=256, max_running_requests=4,
                                                    attention_backend=backend)))
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (13, 4)]
        rows = [d.new() for _ in prompts]
        outs = [[] for _ in prompts]
        nxt = prompts
        seen = []
        for _ in range(10):  # first a mixed prefill of both, then batched decodes
            logits = d.step(list(zip(rows, nxt)))
            seen += logits
            toks = [int(lg[-1].argmax()) for lg in logits]
            for o, t in zip(outs, toks):
                o.append(t)
            nxt = [[t] for t in toks]
        results[backend] = outs
        all_logits[backend] = torch.cat(seen)
    assert results["triton"] == results["torch"]
    torch.testing.assert_close(all_logits["triton"], all_logits["torch"], atol=1e-4, rtol=0)
