"""The reader's finiteness check (eagle3/store/finite.py): what training trusts of every sample's states, at 20x
the speed of torch.isfinite on bf16 (which bounded the store reader at ~25,000 Kimi-shaped tok/s). It must agree
with torch.isfinite(x).all() on every dtype a store holds or a reader makes (bf16, fp16, float32 from fp8), for a
NaN, +inf or -inf anywhere, vector tails included."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle3.store.finite import all_finite, nonfinite_layers

SPECIALS = (float("nan"), float("inf"), -float("inf"))


@given(
    n=st.integers(1, 5000),
    dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)),
    bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=3),
    scale=st.sampled_from((1.0, 1e4, 6e4)),
    seed=st.integers(0, 2**16),
)
def test_all_finite_agrees_with_isfinite(n, dtype, bad, scale, seed):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)  # fp16 * 6e4: some inf
    for pos, v in bad:
        x[pos % n] = v
    assert all_finite(x) == bool(torch.isfinite(x).all())


@given(layer=st.integers(0, 3), row=st.integers(0, 8), v=st.sampled_from(SPECIALS))
def test_nonfinite_layers_names_the_layer_and_counts(layer, row, v):
    hs = torch.randn(9, 4, 16).bfloat16()  # [T, n_layers, H], as read_states returns it
    hs[row, layer, 5] = v
    assert not all_finite(hs)
    assert nonfinite_layers(hs) == ([layer], 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_all_finite_is_isfinite_all_for_every_shape_dtype_and_value(dtype, bad):
    for shape in ((0,), (0, 4, 8), (1,), (3, 4, 8)):
        x = torch.randn(shape).to(dtype)
        if bad is not None and x.numel():
            x.view(-1)[x.numel() // 2] = bad
        assert all_finite(x) == bool(torch.isfinite(x).all()), (shape, dtype, bad)
