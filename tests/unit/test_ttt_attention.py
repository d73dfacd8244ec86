"""The mask-free TTT attention (eagle3/train/ttt_attention.py) computes what speculators' dense mask computes:
output and gradients against a dense reference (the mask written out from its definition), for packed samples of
different lengths, every TTT step, GQA; and inside speculators' draft, the same loss and parameter gradients as its
sdpa path. The CUDA kernels (aten flash, varlen) are the GPU test's (tests/gpu/test_bench_train.py); here the same
merge runs with aten's CPU flash attention sample by sample."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.train import ttt_attention as ta


def dense_reference(q, k, v, doc, scale):
    """speculators' mask from its definition (attention.py's create_combined_mask_mod + the diagonal extension):
    query i sees step-0 key c when c <= i in i's sample, and key j*T + i of every later step j."""
    t, steps = q.shape[2], k.shape[2] // q.shape[2]
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    i = torch.arange(t, device=q.device)[:, None]
    kv = torch.arange(steps * t, device=q.device)[None, :]
    c = kv % t
    allowed = ((kv < t) & (c <= i) & (doc[c] == doc[i])) | ((kv >= t) & (c == i))
    s = (q @ kk.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vv


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    steps=st.integers(1, 3),
    groups=st.sampled_from([(4, 4), (4, 2), (4, 1)]),
    dv=st.sampled_from([8, 5]),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradients_equal_the_dense_mask(lengths, steps, groups, dv, seed):
    """dv < d: the MLA draft's values narrower than its keys (128 under 192)."""
    h, kv = groups
    t, d = sum(lengths), 8
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, t, d, generator=gen, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(1, kv, steps * t, d, generator=gen).requires_grad_()
    v = torch.randn(1, kv, steps * t, dv, generator=gen).requires_grad_()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    cu = ta.forward_kwargs(doc[None])[ta.KWARG]
    assert cu.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    up = torch.randn(1, h, t, dv, generator=gen)
    got = ta.TTTAttention.apply(q, k, v, cu, 0.35)
    grads = torch.autograd.grad((got * up).sum(), (q, k, v))
    want = dense_reference(q, k, v, doc, 0.35)
    wants = torch.autograd.grad((want * up).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", grads, wants):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_it_needs_the_samples_boundaries_and_says_how():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="eagle3_cu_seqlens=cu_seqlens"):
        ta.attention(None, q, q, q)


def test_under_autocast_it_computes_in_the_autocast_dtype_as_sdpa_does():
    """The drafts' rotary embedding leaves q and k in float32 under bf16 autocast (float32 cos/sin); sdpa casts them
    to the autocast dtype, and so must this attention: CUDA's flash kernels take only bf16/fp16 (a float32 query
    stopped every varlen row of the H100 benchmark). Here the output is bf16 and equals the bf16 inputs' output."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 9, 8, generator=gen)
    k, v = torch.randn(1, 2, 18, 8, generator=gen), torch.randn(1, 2, 18, 8, generator=gen).bfloat16()
    cu = ta.forward_kwargs(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = ta.attention(None, q, k, v, scaling=0.3, **cu)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    want, _ = ta.attention(None, q.bfloat16(), k.bfloat16(), v, scaling=0.3, **cu)
    assert got.dtype == sdpa.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def draft_step(b, lengths: list[int], attn: str, mla: bool = False, amp: bool = False):
    """One forward and backward of the trainer benchmark's draft (tests/gpu/test_bench_train._model: seed 0, the
    verifier's weights drawn) attending with ``attn`` ("sdpa" or "varlen"), on random states packed as samples of
    ``lengths``, three TTT steps: (loss, {parameter name: gradient}), float32."""
    from eagle3.train.chunked_loss import loss_config
    from tests.gpu import test_bench_train as gb

    h, t, dev = b.shape.hidden_size, sum(lengths), b.device
    g = torch.Generator(device=dev).manual_seed(3)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    inputs = dict(
        input_ids=torch.randint(0, b.draft_vocab, (1, t), generator=g, device=dev),
        hidden_states=torch.randn(1, t, 3 * h, generator=g, device=dev),
        verifier_last_hidden_states=torch.randn(1, t, h, generator=g, device=dev),
        loss_mask=torch.ones(1, t, dtype=torch.bool, device=dev),
        position_ids=torch.cat([torch.arange(1, n + 1) for n in lengths])[None].to(dev),
        document_ids=doc.to(dev),
    )
    m = gb._model(b, mla=b.mla if mla else None, attn=attn)
    extra = ta.forward_kwargs(doc, dev) if attn == "varlen" else {}
    with torch.compiler.set_stance("force_eager"), torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
        _, loss, _ = m(**inputs, **extra, ttt_steps=3, loss_config=loss_config("kl_div", "auto", dev))
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
def test_the_draft_trains_the_same_with_either_attention(mla):
    """Three packed samples, three TTT steps: speculators' sdpa over its dense mask and this attention give the same
    loss and the same gradient for every parameter (float32, CPU), for the Llama-layer draft and the MLA one (Kimi's
    MLA at a small width: q_lora 24, kv_lora 32, nope 16 + rope 8 keys, values of 12)."""
    from eagle3.train import mla_draft
    from eagle3.train.draft import DraftShape
    from tests.gpu import test_bench_train as gb

    b = gb.Bench(
        DraftShape(64, 512, 4, 2, 16, 128),
        mla_draft.MLAShape(64, 4, 24, 32, 16, 8, 12, 96),
        device="cpu",
        draft_vocab=128,
    )
    (la, ga), (lb, gb_) = (draft_step(b, [7, 12, 5], attn, mla) for attn in ("sdpa", "varlen"))
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb_.keys() and len(ga) > 5
    for n in ga:
        torch.testing.assert_close(ga[n], gb_[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_training_with_varlen_follows_the_sdpa_run_and_exports_the_same_draft_config(small_store, tmp_path):
    """`eagle3 train --attn varlen`: packed samples, the same losses as sdpa's run (float32 CPU, to rounding), and a
    published draft whose config says nothing of the training attention (vLLM serves it as any other)."""
    import json

    from eagle3 import cli
    from eagle3.train.train import TrainConfig, train

    def run(attn):
        return train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp_path / attn),
                draft_vocab_size=256,
                batch_samples=4,
                lr=3e-3,
                seed=0,
                max_steps=4,
                pack_tokens=96,
                attn_impl=attn,
            ),
            progress=False,
        )

    a, b = run("sdpa"), run("varlen")
    assert a.losses == pytest.approx(b.losses, rel=1e-4) and a.tokens_seen == b.tokens_seen
    ca, cb = (json.loads((tmp_path / n / "draft" / "config.json").read_text()) for n in ("sdpa", "varlen"))
    assert ca == cb and ta.NAME not in json.dumps(cb)
    assert cli.build_parser().parse_args(["train", "--store", "s", "--out", "o", "--attn", "varlen"]).attn == "varlen"


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=8))
def test_the_pack_s_boundaries_and_its_longest_sample_whatever_the_order(lengths):
    """cu_seqlens [0, l0, l0 + l1, ...] and the longest sample's rows, which the flash varlen kernels take as
    max_seqlen on CUDA (the CPU's flash attention does not read it, so only this and the GPU test see it wrong)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    fk = ta.forward_kwargs(doc, "cpu")
    assert fk[ta.KWARG].tolist() == [0] + list(itertools.accumulate(lengths))
    assert fk[ta.LONGEST] == max(lengths)
