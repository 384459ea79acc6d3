"""`models.linear`: the CPU projection for small batches equals `torch.nn.functional.linear`."""
import torch
from hypothesis import given, settings, strategies as st

from stemma.models.linear import SMALL_ROWS, Linear, linear


@settings(max_examples=30, deadline=None)
@given(st.integers(1, SMALL_ROWS + 8), st.integers(1, 48), st.integers(1, 40), st.booleans(), st.integers(0, 2**31))
def test_linear_matches_torch_in_float32(rows, n_in, n_out, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if with_bias else None
    got = linear(x, w, b)
    assert got.shape == (rows, n_out)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_small_batches_come_back_transposed_and_large_ones_row_major():
    w = torch.randn(24, 16)
    assert linear(torch.randn(4, 16), w).t().is_contiguous()
    assert linear(torch.randn(1, 16), w).shape == (1, 24)
    assert linear(torch.randn(SMALL_ROWS + 1, 16), w).is_contiguous()


def test_linear_module_keeps_nn_linear_parameters():
    layer = Linear(16, 8, bias=True)
    assert isinstance(layer, torch.nn.Linear) and set(dict(layer.named_parameters())) == {"weight", "bias"}
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
