"""Each Triton kernel against its torch reference, under the Triton interpreter on CPU tensors.

Shapes are tiny and odd: lengths 1, 7, 33, prefixes 0 and 13, mixed batches, head_dim 64, 80, 128,
256, GQA 4:1 and MQA. Slots are a random permutation and the table rows are scattered, so the slot
indirection is really exercised; slots no request owns hold NaN, and the table's stale entries past
each request's length point anywhere, so reading a wrong slot shows.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # Triton reads it when a kernel is decorated: before any import

import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch
import torch.nn.functional as F

from stemma.kernels._triton import is_interpreted
from stemma.kernels.decode_attention import decode_attention, decode_attention_reference
from stemma.kernels.extend_attention import (_extend_attention_kernel, extend_attention,
                                             extend_attention_reference)
from stemma.kernels.kv_write import kv_write, kv_write_reference
from stemma.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from stemma.kernels.rotary import apply_rotary, apply_rotary_reference
from stemma.attention.base import AttentionLayer
from stemma.attention.select import make_attention_backend
from stemma.attention.triton_backend import TritonAttentionBackend
from stemma.executor.forward_batch import ForwardBatch
from stemma.cache.kv_pool import KVPool, ReqToSlot

if not is_interpreted(_extend_attention_kernel):
    raise RuntimeError("stemma.kernels was imported before TRITON_INTERPRET=1 was set; "
                       "set it in conftest.py or before the first import of stemma.kernels")

F32, BF16 = torch.float32, torch.bfloat16
MIXED = [(0, 1), (0, 7), (13, 33), (13, 1), (0, 33), (13, 7)]  # (prefix_len, extend_len) per request


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype == F32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        return
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    cos = F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0)
    assert cos > 0.9999, f"cosine similarity {cos:.6f}"


class ScatteredPool:
    """K/V buffers and a req->slot table: request i's positions hold a random permutation of slots,
    in a scattered table row."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        total = sum(seq_lens) + 9  # 9 slots nobody owns
        shape = (total + 1, num_kv_heads, head_dim)
        self.k_buf = torch.full(shape, float("nan"), dtype=dtype)
        self.v_buf = torch.full(shape, float("nan"), dtype=dtype)
        max_reqs, max_context = len(seq_lens) + 3, max(seq_lens) + 5
        self.table = torch.randint(0, total + 1, (max_reqs, max_context), generator=gen, dtype=torch.int32)
        self.rows = torch.randperm(max_reqs, generator=gen)[:len(seq_lens)]
        slots = torch.randperm(total, generator=gen) + 1
        used = 0
        for row, n in zip(self.rows.tolist(), seq_lens):
            mine = slots[used:used + n]
            used += n
            self.table[row, :n] = mine.to(torch.int32)
            self.k_buf[mine] = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
            self.v_buf[mine] = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)


def extend_inputs(batch, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    prefix = torch.tensor([p for p, _ in batch])
    extend = torch.tensor([e for _, e in batch])
    starts = torch.cumsum(extend, 0) - extend
    pool = ScatteredPool((prefix + extend).tolist(), num_kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((int(extend.sum()), num_heads, head_dim), generator=gen).to(dtype)
    return q, pool, prefix, extend, starts


ATTENTION_CASES = [  # head_dim, Hq, Hkv, dtype, sliding_window, logit_cap
    (64, 8, 2, F32, None, None),
    (64, 4, 1, F32, 5, None),
    (80, 8, 2, F32, None, 1.5),
    (80, 4, 1, F32, 5, 1.5),
    (256, 4, 1, F32, 17, None),
    (128, 8, 2, BF16, None, None),
    (64, 8, 2, BF16, 5, 1.5),
    (80, 4, 1, BF16, None, None),
    (256, 8, 2, BF16, 5, 1.5),
]


def case_id(case):
    d, hq, hkv, dtype, window, cap = case
    return f"d{d}-{hq}:{hkv}-{str(dtype)[6:]}-win{window}-cap{cap}"


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=case_id)
def test_extend_attention_matches_reference(case):
    head_dim, hq, hkv, dtype, window, cap = case
    q, pool, prefix, extend, starts = extend_inputs(MIXED, hq, hkv, head_dim, dtype)
    args = (q, pool.k_buf, pool.v_buf, pool.table, pool.rows, prefix, extend, starts, head_dim ** -0.5)
    out = extend_attention(*args, sliding_window=window, logit_cap=cap, block_m=16, block_n=16)
    assert_close(out, extend_attention_reference(*args, sliding_window=window, logit_cap=cap))


def test_extend_attention_default_blocks_and_strided_q():
    q, pool, prefix, extend, starts = extend_inputs(MIXED, 8, 2, 64, F32)
    q_strided = torch.cat([q, torch.zeros_like(q)], dim=1)[:, :8]  # stride(0) = 2 * Hq * D
    args = (pool.k_buf, pool.v_buf, pool.table, pool.rows, prefix, extend, starts, 0.125)
    out = extend_attention(q_strided, *args, sliding_window=40)
    assert_close(out, extend_attention_reference(q, *args, sliding_window=40))


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=case_id)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_matches_reference(case, num_splits):
    head_dim, hq, hkv, dtype, window, cap = case
    seq_lens = torch.tensor([p + e for p, e in MIXED])
    pool = ScatteredPool(seq_lens.tolist(), hkv, head_dim, dtype)
    q = torch.randn((len(MIXED), hq, head_dim), generator=torch.Generator().manual_seed(5)).to(dtype)
    args = (q, pool.k_buf, pool.v_buf, pool.table, pool.rows, seq_lens, head_dim ** -0.5)
    out = decode_attention(*args, sliding_window=window, logit_cap=cap, num_splits=num_splits, block_n=16)
    assert_close(out, decode_attention_reference(*args, sliding_window=window, logit_cap=cap))


def test_window_of_one_returns_each_tokens_own_value():
    q, pool, prefix, extend, starts = extend_inputs(MIXED, 4, 1, 80, F32)
    ext = extend_attention(q, pool.k_buf, pool.v_buf, pool.table, pool.rows, prefix, extend, starts, 1.0,
                           sliding_window=1, block_m=16, block_n=16)
    seq_lens = prefix + extend
    dec = decode_attention(q[starts + extend - 1], pool.k_buf, pool.v_buf, pool.table, pool.rows, seq_lens,
                           1.0, sliding_window=1, num_splits=2, block_n=16)
    own = torch.cat([pool.table[r, p:p + e] for r, p, e in zip(pool.rows.tolist(), prefix.tolist(),
                                                                 extend.tolist())]).long()
    want = pool.v_buf[own].expand(-1, 4, -1)
    assert_close(ext, want)
    assert_close(dec, want[starts + extend - 1])


def test_references_agree_with_sdpa():
    """The references' causal masking against torch's own, where it applies: no prefix, no window."""
    q, pool, prefix, extend, starts = extend_inputs([(0, 7), (0, 33)], 8, 2, 64, F32)
    ref = extend_attention_reference(q, pool.k_buf, pool.v_buf, pool.table, pool.rows, prefix, extend,
                                     starts, 0.125)
    for row, n, first in zip(pool.rows.tolist(), extend.tolist(), starts.tolist()):
        slots = pool.table[row, :n].long()
        k, v = pool.k_buf[slots].transpose(0, 1), pool.v_buf[slots].transpose(0, 1)
        sdpa = F.scaled_dot_product_attention(q[first:first + n].transpose(0, 1), k, v, is_causal=True,
                                              scale=0.125, enable_gqa=True).transpose(0, 1)
        assert_close(ref[first:first + n], sdpa)
    seq_lens = torch.tensor([13, 33])
    dec_pool = ScatteredPool(seq_lens.tolist(), 2, 64, F32)
    dq = q[:2]
    ref = decode_attention_reference(dq, dec_pool.k_buf, dec_pool.v_buf, dec_pool.table, dec_pool.rows,
                                     seq_lens, 0.125)
    for i, (row, n) in enumerate(zip(dec_pool.rows.tolist(), seq_lens.tolist())):
        slots = dec_pool.table[row, :n].long()
        k, v = dec_pool.k_buf[slots].transpose(0, 1), dec_pool.v_buf[slots].transpose(0, 1)
        sdpa = F.scaled_dot_product_attention(dq[i][:, None], k, v, scale=0.125, enable_gqa=True)
        assert_close(ref[i], sdpa[:, 0])


@pytest.mark.parametrize("in_dtype,buf_dtype", [(F32, F32), (BF16, BF16), (F32, BF16)])
def test_kv_write_matches_reference(in_dtype, buf_dtype):
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn((7, 2, 2, 80), generator=gen).to(in_dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views, as a fused projection would give
    slots = torch.randperm(20, generator=gen)[:7] + 1
    k_buf = torch.randn((21, 2, 80), generator=gen).to(buf_dtype)
    v_buf = torch.randn((21, 2, 80), generator=gen).to(buf_dtype)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    kv_write_reference(k, v, slots, want_k, want_v)
    kv_write(k, v, slots, k_buf, v_buf)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


@pytest.mark.parametrize("shape,dtype,residual,gemma", [
    ((5, 80), F32, False, False),
    ((5, 80), F32, True, True),
    ((3, 4, 64), F32, False, True),
    ((7, 256), F32, True, False),
    ((5, 80), BF16, True, False),
    ((3, 4, 64), BF16, False, False),
    ((7, 256), BF16, True, True),
])
def test_rmsnorm_matches_reference(shape, dtype, residual, gemma):
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype) if residual else None
    out = rmsnorm(x, weight, 1e-6, residual=res, gemma=gemma)
    ref = rmsnorm_reference(x, weight, 1e-6, residual=res, gemma=gemma)
    if not residual:
        assert_close(out, ref)
        return
    assert_close(out[0], ref[0])
    assert torch.equal(out[1], ref[1]), "x + residual must round as an unfused add does"


def rotary_cache(max_pos: int, head_dim: int):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=F32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=F32), inv_freq)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("head_dim,hq,hk,dtype", [(64, 8, 2, F32), (80, 4, 1, F32), (256, 8, 2, F32),
                                                  (64, 4, 1, BF16), (80, 8, 2, BF16), (256, 4, 1, BF16)])
def test_rotary_matches_reference(head_dim, hq, hk, dtype):
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn((7, hq + 2 * hk, head_dim), generator=gen).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]  # strided views, rotated in place
    positions = torch.tensor([0, 45, 3, 17, 99, 1, 62])
    cos, sin = rotary_cache(100, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_reference(q_ref, k_ref, positions, cos, sin)
    apply_rotary(q, k, positions, cos, sin)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(q[0], q_ref[0]) and torch.equal(qkv[0, :hq], q_ref[0]), "position 0 rotates by 0"


def test_rotary_reference_matches_hf_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn((5, 4, 80), generator=gen), torch.randn((5, 1, 80), generator=gen)
    positions = torch.tensor([0, 9, 2, 31, 4])
    cos, sin = rotary_cache(32, 80)
    full_cos = torch.cat([cos, cos], dim=-1)[positions]  # HF keeps both halves: [T, D]
    full_sin = torch.cat([sin, sin], dim=-1)[positions]
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, full_cos, full_sin, unsqueeze_dim=1)
    apply_rotary_reference(q, k, positions, cos, sin)
    assert_close(q, hf_q)
    assert_close(k, hf_k)


def run_backend(backend, layer: AttentionLayer, steps, dtype):
    """Runs forward over the given steps (lists of (row, prefix_len, new_len)) on a fresh pool."""
    gen = torch.Generator().manual_seed(8)
    pool = KVPool(1, 120, layer.num_kv_heads, layer.head_dim, dtype)
    table = ReqToSlot(4, 64)
    order = torch.randperm(120, generator=gen) + 1  # slots handed out in scattered order
    used, outs = 0, []
    for step in steps:
        new = sum(n for _, _, n in step)
        out_slots = order[used:used + new]
        used += new
        offset = 0
        for row, prefix, n in step:
            table.write(row, prefix, out_slots[offset:offset + n])
            offset += n
        fb = ForwardBatch.build(token_lists=[[1] * n for _, _, n in step], req_rows=[r for r, _, _ in step],
                                prefix_lens=[p for _, p, _ in step], out_slots=out_slots,
                                req_to_slot=table.table)
        backend.begin(fb)
        q = torch.randn((new, layer.num_heads, layer.head_dim), generator=gen).to(dtype)
        k = torch.randn((new, layer.num_kv_heads, layer.head_dim), generator=gen).to(dtype)
        v = torch.randn((new, layer.num_kv_heads, layer.head_dim), generator=gen).to(dtype)
        outs.append(backend.forward(q, k, v, layer, pool))
    return outs, pool


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_backend_matches_torch_backend(dtype):
    torch_backend = pytest.importorskip("stemma.attention.torch_backend")
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=1, head_dim=80, scale=80 ** -0.5,
                           sliding_window=6, logit_cap=2.0)
    steps = [[(2, 0, 7), (0, 0, 13)],             # prefill
             [(2, 7, 1), (0, 13, 20), (3, 0, 1)],  # mixed: decode, extend, one-token prefill
             [(2, 8, 1), (0, 33, 1), (3, 1, 1)]]   # decode
    got, got_pool = run_backend(TritonAttentionBackend((6,)), layer, steps, dtype)
    want, want_pool = run_backend(torch_backend.TorchAttentionBackend((6,)), layer, steps, dtype)
    # told of no window, the torch backend gathers every key and masks: its windowed decode
    # (the last 6 keys of each request only) must give the same
    masked, _ = run_backend(torch_backend.TorchAttentionBackend(), layer, steps, dtype)
    assert torch.equal(got_pool.k[0], want_pool.k[0]) and torch.equal(got_pool.v[0], want_pool.v[0])
    for g, w, m in zip(got, want, masked):
        assert_close(g, w)
        assert_close(m, w)


def test_make_attention_backend_triton():
    assert isinstance(make_attention_backend("triton", "cpu"), TritonAttentionBackend)


def test_kernels_import_without_triton_and_fail_clearly_at_launch():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from stemma.kernels.kv_write import kv_write\n"
            "import stemma.kernels.extend_attention, stemma.kernels.decode_attention\n"
            "import stemma.kernels.rmsnorm, stemma.kernels.rotary\n"
            "x = torch.zeros(1, 1, 8)\n"
            "try:\n"
            "    kv_write(x, x, torch.zeros(1, dtype=torch.int64), x, x)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "need the `triton` package" in result.stdout


def test_kernels_compile_for_cuda():
    """The interpreter never runs Triton's compiler; this compiles every launch to a cubin."""
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    script = os.path.join(os.path.dirname(__file__), "kernel_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled 12 kernel launches" in result.stdout


def test_kernel_benchmark_runs_in_smoke_mode():
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "kernels.py")
    result = subprocess.run([sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for op in ("decode", "prefill", "extend", "rmsnorm+residual", "rotary", "kv_write"):
        assert f"\n{op} " in result.stdout
