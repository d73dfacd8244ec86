"""The sdpa draft's dense attention mask, built by broadcasting its mask function (train/dense_mask.py), not by
flex_attention.create_mask's vmap (a fifth of a CPU training step): the same boolean mask, packed samples, padding
(document id -1) and sliding windows included, and the trainer uses it."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from speculators.models.eagle3.attention import create_combined_mask_mod
from torch.nn.attention.flex_attention import create_mask

from eagle3.train import dense_mask


@st.composite
def packs(draw):
    """Document ids [T] of a pack: samples of 1-9 tokens, ids 0, 1, ...; maybe padding (-1) at the end."""
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    ids = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * draw(st.integers(0, 4))
    return torch.tensor(ids)


@given(packs(), st.one_of(st.none(), st.integers(1, 6)))
def test_the_broadcast_mask_is_create_mask_s(doc_ids, window):
    t = doc_ids.numel()
    mod = create_combined_mask_mod(doc_ids, t, sliding_window=window)
    want = create_mask(mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    got = dense_mask.create_mask(mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    assert got.dtype == want.dtype == torch.bool and got.shape == want.shape == (1, 1, t, t)
    assert torch.equal(got, want)


def test_a_longer_key_axis_and_batch_and_heads_are_create_mask_s():
    """KV_LEN past Q_LEN (the draft's TTT steps' keys, kv % T) and B, H given: still create_mask's."""
    doc_ids = torch.tensor([0, 0, 0, 1, 1, -1])
    mod = create_combined_mask_mod(doc_ids, 6)
    want = create_mask(mod, B=2, H=3, Q_LEN=6, KV_LEN=18, device="cpu")
    assert torch.equal(dense_mask.create_mask(mod, B=2, H=3, Q_LEN=6, KV_LEN=18, device="cpu"), want)


def test_the_sdpa_draft_builds_its_mask_with_it(small_store, tmp_path, monkeypatch):
    """The trainer's sdpa draft builds each step's mask with the broadcast builder (flex_attention's never called)."""
    from speculators.models.eagle3 import core

    from eagle3.train.train import TrainConfig, train

    calls = []
    fast = dense_mask.create_mask
    monkeypatch.setattr(dense_mask, "create_mask", lambda *a, **kw: calls.append(1) or fast(*a, **kw))
    monkeypatch.setattr(core, "create_mask", lambda *a, **kw: calls.append("flex") or create_mask(*a, **kw))
    cfg = TrainConfig(store=str(small_store), out=str(tmp_path / "run"), draft_vocab_size=256, batch_samples=4,
                      max_steps=2, attn_impl="sdpa", checkpoint_every=0)  # fmt: skip
    assert train(cfg, progress=False).steps == 2
    assert calls and "flex" not in calls, calls
