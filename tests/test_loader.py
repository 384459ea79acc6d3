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
