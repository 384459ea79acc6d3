"""stemma's models against Hugging Face transformers on tiny random checkpoints, in float32."""
import pytest
import torch

from stemma.executor.runner import ModelRunner, RunnerConfig
from stemma.loader.model import load_model
from tests.driver import Driver
from tests.tiny_models import build_tiny

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    folder = build_tiny(request.param, tmp_path_factory.mktemp(request.param), shard=request.param == "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    loaded = load_model(folder, dtype="float32")
    return request.param, hf, loaded


def runner_for(loaded):
    return Driver(ModelRunner(loaded, RunnerConfig(kv_pool_tokens=1024, max_running_requests=8,
                                                   attention_backend="torch")))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (n,), generator=g).tolist()


def test_prefill_logits(pair):
    _, hf, loaded = pair
    ids = seq(21, 1)  # longer than the sliding window (8)
    d = runner_for(loaded)
    ours = d.step([(d.new(), ids)], all_logits=True)[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_decode_logits(pair):
    _, hf, loaded = pair
    ids = seq(24, 2)
    ref = hf_logits(hf, ids)
    d = runner_for(loaded)
    row = d.new()
    got = [d.step([(row, ids[:5])])[0][-1]]
    got += [d.step([(row, [t])])[0][-1] for t in ids[5:]]
    torch.testing.assert_close(torch.stack(got), ref[4:], atol=ATOL, rtol=0)


def test_prefix_then_extend(pair):
    _, hf, loaded = pair
    ids = seq(23, 3)
    d = runner_for(loaded)
    row = d.new()
    d.step([(row, ids[:9])])
    ours = d.step([(row, ids[9:])], all_logits=True)[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids)[9:], atol=ATOL, rtol=0)


def test_mixed_batch(pair):
    _, hf, loaded = pair
    a, b, c = seq(12, 4), seq(19, 5), seq(16, 6)
    d = runner_for(loaded)
    ra, rb, rc = d.new(), d.new(), d.new()
    d.step([(rb, b[:7]), (rc, c[:15])])
    # a prefills fresh, b extends a cached prefix, c decodes one token
    la, lb, lc = d.step([(ra, a), (rb, b[7:]), (rc, c[15:])], all_logits=True)
    torch.testing.assert_close(la, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, hf_logits(hf, b)[7:], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, hf_logits(hf, c)[15:], atol=ATOL, rtol=0)


def test_extends_of_different_lengths_share_one_padded_group(pair):
    """Three requests extend by 3, 10 and 17 tokens over prefixes 0, 4 and 9 in one forward; the
    torch backend pads them into one group (queries past a request's length are discarded)."""
    _, hf, loaded = pair
    a, b, c = seq(3, 9), seq(14, 10), seq(26, 11)
    d = runner_for(loaded)
    ra, rb, rc = d.new(), d.new(), d.new()
    d.step([(rb, b[:4]), (rc, c[:9])])
    la, lb, lc = d.step([(ra, a), (rb, b[4:]), (rc, c[9:])], all_logits=True)
    torch.testing.assert_close(la, hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, hf_logits(hf, b)[4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, hf_logits(hf, c)[9:], atol=ATOL, rtol=0)


def test_greedy_matches_generate(pair):
    _, hf, loaded = pair
    prompt = seq(10, 7)
    hf.generation_config.eos_token_id = None  # plain greedy: 32 tokens, EOS neither stops nor is banned
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ref) == 32
    assert runner_for(loaded).greedy(prompt, 32) == ref


def test_pool_whole_after_runs(pair):
    _, _, loaded = pair
    d = runner_for(loaded)
    d.greedy(seq(5, 8), 4)
    alloc = d.runner.pool.allocator
    used = sum(d.lens.values())
    assert alloc.available + used == alloc.total
