"""Tensor parallel over gloo (issue 20): tiny random llama and gemma3 checkpoints at tp=2 give the
logits of tp=1 (fp32) and, through the engine invariance cases, its greedy outputs; the
quantized stores split the same way; a model that does not split is refused up front."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import stemma
from tests.test_engine import CASES, GREEDY, finish_clean, make, prompts
from tests.tiny_models import build_tiny

# Row-parallel layers sum their ranks' partial products: in fp32 that rounds differently from
# one matmul over the whole width. The tiny models' activations reach ~70 (ulp 7.6e-6) and their
# logits ~10: the gaps measured here were up to 2.3e-5 (llama) and 3.8e-6 (gemma3), so issue 20's
# 1e-5 does not hold for the llama one. That is fp32's own rounding on this checkpoint: on the
# same forwards, HF transformers' fp32 logits are 3.1e-5 from its float64 ones (stemma at tp=1:
# 5.2e-5; gemma3: 4.1e-6 and 4.6e-6). A wrong slice or a missed sum is off by O(1).
LOGIT_ATOL = 5e-5


# what the model's shape does not change (serving, workers, tp=4) runs on gemma3 only with -m slow
LLAMA_BY_DEFAULT = pytest.mark.parametrize(
    "folder", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)], indirect=True)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def folder(request, tmp_path_factory):
    return str(build_tiny(request.param, tmp_path_factory.mktemp(f"tp_{request.param}")))


@pytest.fixture(scope="module")
def reference(folder):
    engine = make(folder)
    ref = [engine.generate(p, GREEDY).token_ids for p in prompts()]
    finish_clean(engine)
    return ref


def logits_of(engine) -> torch.Tensor:
    """A prefill of two prompts, then a decode over their cached KV: every logit of both forwards."""
    runner = engine.runner
    first = runner.prepare([[5, 6, 7, 8, 9, 10], [11, 12, 13]], [0, 1], [0, 0], logit_starts=[0, 0])
    second = runner.prepare([[14], [15]], [0, 1], [6, 3])
    with torch.inference_mode():
        out = torch.cat([runner.forward(first), runner.forward(second)])
    runner.pool.allocator.free(torch.cat([first.out_slots, second.out_slots]))
    return out.float()


def test_logits_match_tp1(folder):
    one, two = make(folder), make(folder, tp=2)
    gap = (logits_of(one) - logits_of(two)).abs().max().item()
    assert gap <= LOGIT_ATOL, gap
    assert_listening_on_loopback_only(two)
    finish_clean(two)


def test_row_parallel_biases_reach_every_rank(tmp_path):
    """o_proj and down_proj biases (attention_bias, mlp_bias): the bias was added after the sum
    on rank 0 alone, so the other ranks went on without it (logits 0.9 off)."""
    folder = str(build_tiny("llama", tmp_path / "biased", attention_bias=True, mlp_bias=True))
    one, two = make(folder), make(folder, tp=2)
    gap = (logits_of(one) - logits_of(two)).abs().max().item()
    assert gap <= LOGIT_ATOL, gap
    assert [o.token_ids for o in two.generate(prompts()[:3], GREEDY)] == \
        [o.token_ids for o in one.generate(prompts()[:3], GREEDY)]
    finish_clean(two)


def listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def assert_listening_on_loopback_only(engine) -> None:
    """The ranks' sockets: the rendezvous was a TCPStore, which listens on every interface
    whatever host it is given, with no authentication, for the engine's whole life."""
    loopback = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1, ::1
    for pid in [os.getpid(), *(proc.pid for proc in engine.tp_workers.procs)]:
        addresses = listening(pid)
        assert all(a.startswith(loopback) for a in addresses), (pid, addresses)


@LLAMA_BY_DEFAULT
def test_fewer_kv_heads_than_ranks_are_replicated(folder):
    """tp=4 over 2 KV heads: each rank holds one query head and the KV head it reads."""
    four = make(folder, tp=4)
    assert four.loaded.spec.num_heads == 1 and four.runner.pool.k[0].shape[1] == 1
    gap = (logits_of(make(folder)) - logits_of(four)).abs().max().item()
    assert gap <= LOGIT_ATOL, gap
    out = four.generate(prompts()[:3], GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in make(folder).generate(prompts()[:3], GREEDY)]
    finish_clean(four)


# batched and kv_pressure (with retraction) run by default; the other cases with -m slow
@pytest.mark.parametrize("case", ["batched", pytest.param("radix_off", marks=pytest.mark.slow),
                                  pytest.param("chunked_32", marks=pytest.mark.slow),
                                  pytest.param("policy_sjf", marks=pytest.mark.slow), "kv_pressure"])
def test_greedy_invariance_at_tp2(folder, reference, case):
    options = CASES.get(case, {})
    if case == "kv_pressure":
        need = sum(len(p) + GREEDY.max_new_tokens for p in prompts())
        options = {"kv_pool_tokens": need // 4, "chunked_prefill_size": 32}
    engine = make(folder, tp=2, **options)
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference
    if case == "kv_pressure":
        assert engine.stats()["retractions"] > 0
    finish_clean(engine)


def test_int8_stores_split_the_same_way(folder):
    one = make(folder, quantization="int8")
    ref = [one.generate(p, GREEDY).token_ids for p in prompts()[:6]]
    two = make(folder, quantization="int8", tp=2)
    assert set(two.loaded.stores.values()) >= {"int8"}
    assert [o.token_ids for o in two.generate(prompts()[:6], GREEDY)] == ref
    finish_clean(two)


@LLAMA_BY_DEFAULT
def test_workers_hold_a_slice_and_stop_with_their_engine(folder):
    engine = make(folder, tp=2)
    spec = engine.loaded.spec
    whole = make(folder).loaded.spec
    assert spec.num_heads == whole.num_heads // 2 and spec.vocab_size == whole.vocab_size
    assert engine.runner.pool.k[0].shape[1] == max(1, whole.num_kv_heads // 2)  # its KV heads only
    (proc,) = engine.tp_workers.procs
    del engine
    gc.collect()
    assert proc.wait(20) == 0


def test_a_dead_rank_stops_the_engine_with_its_name(folder):
    engine = make(folder, tp=2)
    (proc,) = engine.tp_workers.procs
    proc.kill()
    proc.wait()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
        engine.generate(prompts()[0], GREEDY)


def test_a_model_that_does_not_split_is_refused(folder):
    with pytest.raises(ValueError, match="tp=3 does not divide its 4 query heads"):
        make(folder, tp=3)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        make(folder, tp=0)


@LLAMA_BY_DEFAULT
def test_served_at_tp2(folder, reference):
    with stemma.Runtime(folder, tp=2, dtype="float32", attention_backend="torch", speculative="none",
                        kv_pool_tokens=2048) as rt:
        outs = [rt.client.generate(p, GREEDY.to_dict(), timeout=120).token_ids for p in prompts()[:4]]
        engine_pid = rt.client.info()["stats"]["pid"]
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == engine_pid]
    assert outs == reference[:4]
    assert len(workers) == 1


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
