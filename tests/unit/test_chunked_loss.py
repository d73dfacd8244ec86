"""The chunked KL loss (train/chunked_loss.py; TrainConfig.loss_impl "chunked", the default on CUDA): the same values
and gradients as speculators' eager kl_div_loss, without keeping its float32 [T, V] log-softmax and softmax for the
backward pass (at Kimi-K2.5's draft vocabulary of 32,000 and 32k tokens: 4 GiB each, per TTT step)."""

import pytest
import torch
from speculators.losses.eager import kl_div_loss

from eagle3.train.chunked_loss import chunked_kl_div_loss, kl_div_chunked, loss_config
from eagle3.train.train import TrainConfig, train

from .conftest import NARROW_DRAFT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [8, 37, 1000])  # not dividing T, T itself, more than T
def test_values_and_gradients_are_the_eager_loss_s(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 37, 50, generator=g) * 3).to(dtype).requires_grad_()
    targets = (torch.randn(1, 37, 50, generator=g) * 3).to(dtype)
    upstream = torch.rand(1, 37, generator=g)
    want = kl_div_loss(logits, targets)
    (want_grad,) = torch.autograd.grad((want * upstream).sum(), logits)
    got = kl_div_chunked(logits, targets, chunk)
    (got_grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (1, 37)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the gradient is rounded to bf16 either way
    torch.testing.assert_close(got_grad.float(), want_grad.float(), atol=tol, rtol=tol)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of fn(*args), beyond the inputs themselves."""
    inputs = {a.data_ptr() for a in args if torch.is_tensor(a)}
    saved = []

    def pack(t):
        saved.append(0 if t.data_ptr() in inputs else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(saved)


def test_it_keeps_no_float32_copy_of_the_logits_for_the_backward_pass():
    logits = torch.randn(1, 512, 2000, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randn(1, 512, 2000, dtype=torch.bfloat16)
    full = 512 * 2000 * 4  # one float32 [T, V]
    assert _saved_bytes(kl_div_loss, logits, targets) >= 2 * full  # speculators' eager: log q and p
    assert _saved_bytes(lambda a, b: kl_div_chunked(a, b, 64), logits, targets) == 0


def test_training_with_the_chunked_loss_follows_the_eager_curve(small_store, tmp_path):
    runs = {
        impl: train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp_path / impl),
                draft_vocab_size=256,
                batch_samples=8,
                lr=3e-3,
                max_steps=4,
                seed=0,
                loss_impl=impl,
                **NARROW_DRAFT,  # three TTT steps, the default: the loss of each
            ),
            progress=False,
        )
        for impl in ("eager", "chunked")
    }
    assert runs["chunked"].losses == pytest.approx(runs["eager"].losses, rel=1e-5), runs
    assert chunked_kl_div_loss.__name__ == "chunked_kl_div_loss"


def test_an_unknown_loss_implementation_is_refused_with_the_choices(small_store, tmp_path):
    with pytest.raises(ValueError, match="chunked"):
        train(
            TrainConfig(store=str(small_store), out=str(tmp_path / "x"), max_steps=1, loss_impl="lazy"), progress=False
        )


def test_the_default_is_chunked_on_cuda_and_eager_elsewhere():
    assert loss_config("kl_div", "auto", "cuda:0") == {"kl_div": (chunked_kl_div_loss, 1.0)}
    assert loss_config("kl_div", "auto", "cpu")["kl_div"][0] is kl_div_loss
    assert loss_config("kl_div", "eager", "cuda")["kl_div"][0] is kl_div_loss
    with pytest.raises(ValueError, match="for loss 'tv' use eager or fused"):
        loss_config("tv", "chunked")
