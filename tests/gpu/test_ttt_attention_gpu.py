"""The mask-free TTT attention's CUDA kernels (eagle3/train/ttt_attention.py: aten's varlen flash attention forward
and backward, given the merged output and log-sum-exp) against speculators' dense mask, on the GPU: the CPU tests
(tests/unit/test_ttt_attention.py) run the same merge with aten's CPU flash attention, so what only this checks is
the CUDA calls (packed layout, the log-sum-exp's shape, GQA, the backward's arguments). bf16 as the trainer runs it
(autocast), judged against the same bf16 inputs in float32. Seconds; in `pytest -m gpu`."""

import pytest
import torch

from eagle3.train import ttt_attention as ta

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("heads", [(16, 2, 128, 128), (16, 16, 192, 128)], ids=["llama-gqa", "mla"])
def test_flash_varlen_equals_the_dense_mask_in_bf16(steps, heads):
    """llama-gqa: Kimi's llama draft's head groups (64 x 128 over 8 KV heads: g = 8); mla: Kimi's MLA draft's keys of
    128 + 64 over values of 128, which the flash kernels take padded to 192."""
    from tests.unit.test_ttt_attention import dense_reference

    lengths, (h, kv, d, dv) = [300, 1000, 37, 711], heads
    t = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, h, t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(1, kv, steps * t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(1, kv, steps * t, dv, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    fk = ta.forward_kwargs(doc[None], "cuda")
    up = torch.randn(1, h, t, dv, device="cuda", generator=g)
    got = ta.TTTAttention.apply(q, k, v, fk[ta.KWARG], d**-0.5, fk[ta.LONGEST])
    grads = torch.autograd.grad((got.float() * up).sum(), (q, k, v))
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = dense_reference(qf, kf, vf, doc.cuda(), d**-0.5)
    wants = torch.autograd.grad((want * up).sum(), (qf, kf, vf))
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2, _rel(got, want)
    errs = {n: _rel(a, b) for n, a, b in zip("qkv", grads, wants)}
    assert all(e < 2e-2 for e in errs.values()), errs


def test_the_kimi_width_draft_trains_the_same_with_either_attention():
    """Kimi-K2.5's draft layer width (hidden 7168, 64 x 128 heads, 8 KV heads; MLP narrowed to fit beside two copies),
    three packed samples, three TTT steps, bf16 autocast: the loss and every gradient of the varlen draft against the
    sdpa draft's from the same weights."""
    from eagle3.train.draft import DraftShape
    from tests.gpu import test_bench_train as gb
    from tests.unit.test_ttt_attention import draft_step

    b = gb.Bench(DraftShape(7168, 2048, 64, 8, 128, 32000), None, device="cuda", draft_vocab=2048)
    (la, ga), (lb, gb_) = (draft_step(b, [512, 1500, 300], attn, amp=True) for attn in ("sdpa", "varlen"))
    assert abs(float(la - lb)) <= 1e-2 * abs(float(la)), (la, lb)
    errs = sorted(((_rel(gb_[n], ga[n]), n) for n in ga), reverse=True)  # bf16: two kernels' rounding, no more
    assert ga.keys() == gb_.keys() and errs[0][0] < 0.1 and errs[len(errs) // 2][0] < 2e-2, errs[:5]
