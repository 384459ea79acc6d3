"""Loader errors and dtypes."""
import json

import pytest
import torch

from stemma.loader.model import load_model
from tests.driver import Driver
from stemma.executor.runner import ModelRunner, RunnerConfig
from tests.tiny_models import build_tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_folder_without_weights(folder, tmp_path):
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(tmp_path)


def test_shape_mismatch_names_the_tensor(folder, tmp_path):
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight'"):
        load_model(tmp_path)


def test_bfloat16_tracks_float32(folder):
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(folder, dtype=dtype)
        assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)
        d = Driver(ModelRunner(loaded, RunnerConfig(kv_pool_tokens=64, attention_backend="torch")))
        logits[dtype] = d.step([(d.new(), ids)], all_logits=True)[0].float()
    cos = torch.nn.functional.cosine_similarity(logits["float32"], logits["bfloat16"], dim=-1)
    assert cos.min() > 0.99


def _prefill_gap(folder) -> float:
    """Max |logit difference| of stemma's prefill against transformers' forward."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = [(7 * i + 3) % 96 for i in range(21)]
    d = Driver(ModelRunner(load_model(folder, dtype="float32"), RunnerConfig(kv_pool_tokens=256)))
    ours = d.step([(d.new(), ids)], all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize("arch, key, value", [
    ("llama", "sliding_window", 8),                   # transformers' llama ignores it (every layer slid)
    ("gemma3", "attn_logit_softcapping", 5.0),        # transformers' gemma3 never applies it
])
def test_config_keys_transformers_ignores_change_nothing(tmp_path, arch, key, value):
    folder = build_tiny(arch, tmp_path / arch)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    assert _prefill_gap(folder) < 1e-4


def test_models_stemma_does_not_run_are_refused_by_name(tmp_path):
    from transformers import Gemma3Config
    from stemma.models.spec import spec_from_config
    with pytest.raises(ValueError, match="multimodal checkpoint"):  # was an AttributeError after reading every weight
        spec_from_config(Gemma3Config(architectures=["Gemma3ForConditionalGeneration"]))
    folder = build_tiny("gemma3", tmp_path / "embedding", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):  # was loaded as causal
        load_model(folder)


def test_model_safetensors_is_read_beside_other_safetensors(tmp_path):
    """As transformers: a folder with model.safetensors and, say, mistral's consolidated.safetensors
    (another layout of the same weights) reads the former ("has no place" errors before)."""
    folder = build_tiny("mistral", tmp_path / "mistral")
    from safetensors.torch import save_file
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(folder / "consolidated.safetensors"))
    assert _prefill_gap(folder) < 1e-4
