"""The real default model (Gemma 3 270M, Q4_K_M GGUF) against transformers' own GGUF loader.

transformers dequantizes the same file with the `gguf` package; stemma uses its own loader and
dequantizers. Greedy continuations must be token-identical in float32.
"""
from pathlib import Path

import pytest
import torch

import stemma
from stemma import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def engine():
    return stemma.Engine(dtype="float32", quantization="none", kv_pool_tokens=4096, max_running_requests=8)


@pytest.fixture(scope="module")
def hf_model(engine):
    import gguf
    from transformers import AutoModelForCausalLM
    path = Path(engine.loaded.source)
    # transformers parses the file's header twice (for the config, then for the weights), 17 s
    # each on 2 cores (the 262k-token vocabulary): the second parse reuses the first's reader,
    # which it only reads
    reader, parse = None, gguf.GGUFReader

    def parse_once(file, *args, **kwargs):
        nonlocal reader
        if Path(file) != path or args or kwargs:
            return parse(file, *args, **kwargs)
        reader = reader or parse(file)
        return reader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", parse_once)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    assert reader is not None  # the patch was what transformers called
    return model.eval()


def test_greedy_matches_transformers_gguf(engine, hf_model):
    ids = [engine.tokenize(p) for p in PROMPTS]
    outs = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True))
    hf_model.generation_config.eos_token_id = None
    for prompt_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
                                    pad_token_id=0)[0, len(prompt_ids):].tolist()
        assert out.token_ids == ref
    engine.check_pool_whole()


def test_prefill_logits_close_to_transformers(engine, hf_model):
    ids = engine.tokenize(PROMPTS[2])
    out = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=1, logprob_start=1))
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    expected = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), expected, atol=1e-3, rtol=0)


def test_text_is_coherent_english(engine):
    out = engine.generate("The capital of France is", SamplingParams(temperature=0, max_new_tokens=8))
    assert "Paris" in out.text or "capital" in out.text
