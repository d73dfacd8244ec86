"""`train --attn flex` over a run's packs, whose lengths are rarely a multiple of 128.

speculators 0.9.0 extends the draft's flex block mask for each TTT step with BlockMask.from_kv_blocks, which rounds the
sequence up to whole 128-token blocks; torch's flex_attention then refuses the pack (the eb52e7a run on an H100, the
first step of the compiled flex row over a training run's packs: "block_mask was created for block_mask.shape=(1, 1,
8192, 16384) but got q_len=8173 and kv_len=16346"). The fixed-length benchmark rows (8,192 = 64 blocks) never saw it.
The trainer pads a flex pack to whole blocks with rows of a document of their own that no loss reads: the loss and
accuracies are those of the unpadded pack under sdpa, and the run counts only the samples' tokens."""

import pytest
import torch

from eagle3.train import train as train_mod
from eagle3.train.chunked_loss import loss_config
from eagle3.train.train import FLEX_BLOCK, pack_inputs, pack_multiple
from tests.gpu import test_bench_train as gb

from .test_bench_train_rehearsal import SMALL
from .test_pack import _reference, _sample


def test_a_flex_pack_is_padded_to_whole_blocks_with_rows_no_loss_reads():
    xs = [_sample(s, n, torch.bfloat16) for s, n in enumerate([52, 75])]  # 51 + 74 = 125 rows
    got, want = pack_inputs(xs, 2, multiple=FLEX_BLOCK), _reference(xs, 2)
    assert got["input_ids"].shape[1] == 128
    for k in want:  # the samples' rows as before, the pad after them
        assert torch.equal(got[k][:, :125], want[k]), k
    assert not got["loss_mask"][0, 125:].any() and (got["document_ids"][0, 125:] == 2).all()
    assert (got["position_ids"][0, 125:] == 0).all() and not got["hidden_states"][0, 125:].any()
    assert train_mod.sample_rows(got) == 125
    exact = pack_inputs([_sample(0, 129, torch.bfloat16)], 2, multiple=FLEX_BLOCK)
    assert exact["input_ids"].shape[1] == 128 and train_mod.sample_rows(exact) == 128  # no pad where none is needed


def test_only_flex_packs_are_padded():
    assert pack_multiple("flex") == FLEX_BLOCK == 128
    assert pack_multiple("sdpa") == pack_multiple("varlen") == 1


@pytest.mark.parametrize("lengths", [[52, 75], [130, 9, 40]])
def test_flex_over_a_padded_pack_computes_the_loss_sdpa_computes_unpadded(lengths):
    """Forward only (torch has no flex backward on the CPU): the same weights, flex attention over the padded pack,
    sdpa over the pack as it was."""
    flex, sdpa = gb._model(SMALL, attn="flex"), gb._model(SMALL)
    sdpa.load_state_dict(flex.state_dict())
    g, h = torch.Generator().manual_seed(0), SMALL.shape.hidden_size
    xs = [
        {
            "sample_id": f"s{s}",
            "input_ids": torch.randint(0, SMALL.draft_vocab, (n,), generator=g),
            "loss_mask": torch.rand(n, generator=g) > 0.2,
            "aux": torch.randn(n, 3 * h, generator=g),
            "last": torch.randn(n, h, generator=g),
        }
        for s, n in enumerate(lengths)
    ]
    cfg = loss_config("kl_div", "eager")
    with torch.no_grad():
        _, loss_pad, m_pad = flex(**pack_inputs(xs, 2, multiple=FLEX_BLOCK), ttt_steps=3, loss_config=cfg)
        _, loss, m = sdpa(**pack_inputs(xs, 2), ttt_steps=3, loss_config=cfg)
    assert torch.allclose(loss_pad, loss, rtol=1e-4, atol=1e-5), (float(loss_pad), float(loss))
    for k in m:
        if k.startswith("full_acc_"):
            assert torch.allclose(torch.as_tensor(m_pad[k]).float(), torch.as_tensor(m[k]).float(), atol=1e-6), k


def test_train_packs_for_flex_in_whole_blocks(small_store, tmp_path, monkeypatch):
    """train() asks its reader for packs of whole blocks where it attends with flex, and for exact packs otherwise
    (flex itself cannot train on the CPU: the reader's first call is where this stops)."""
    from eagle3 import preflight

    from .test_read_ahead import _cfg

    class Read(Exception):
        pass

    seen = []

    def read_packs(samples, indices, pack_tokens, guard, pin, skipped=None, multiple=1):
        seen.append(multiple)
        raise Read

    monkeypatch.setattr(train_mod, "read_packs", read_packs)
    monkeypatch.setattr(preflight, "train_attention", lambda *a: None)
    for attn in ("flex", "sdpa"):
        with pytest.raises(Read):
            train_mod.train(_cfg(small_store, tmp_path / attn, attn_impl=attn), progress=False)
    assert seen == [FLEX_BLOCK, 1]


def test_padded_packs_train_as_the_packs_did_and_count_only_the_samples_tokens(small_store, tmp_path, monkeypatch):
    """sdpa over packs padded as flex's are (pack_multiple patched): the same losses, and tokens_seen the samples'
    tokens, not the pad's."""
    from .test_read_ahead import _cfg

    plain = train_mod.train(_cfg(small_store, tmp_path / "plain", max_steps=3), progress=False)
    monkeypatch.setattr(train_mod, "pack_multiple", lambda attn: FLEX_BLOCK)
    padded = train_mod.train(_cfg(small_store, tmp_path / "padded", max_steps=3), progress=False)
    assert padded.tokens_seen == plain.tokens_seen
    assert padded.losses == pytest.approx(plain.losses, rel=1e-4), (padded.losses, plain.losses)


def test_the_benchmark_pads_a_flex_run_s_packs_as_the_trainer_does():
    """The compiled flex row over a training run's packs (tests/gpu/test_bench_train._compiled_run_row) builds its
    packs with _inputs: for flex, whole blocks (the pad a document of its own, no loss, position 0); for the others,
    the pack as it was."""
    x = gb._inputs(SMALL, 123, "flex", [50, 73])
    assert x["input_ids"].shape[1] == 128 and int(x["loss_mask"].sum()) == 123 and train_mod.sample_rows(x) == 123
    assert (x["document_ids"][0, 123:] == 2).all() and not x["hidden_states"][0, 123:].any()
    cfg = loss_config("kl_div", "eager")
    with torch.no_grad():
        _, loss, _ = gb._model(SMALL, attn="flex")(**x, ttt_steps=3, loss_config=cfg)
    assert torch.isfinite(loss)
    assert gb._inputs(SMALL, 123, "sdpa", [50, 73])["input_ids"].shape[1] == 123
    assert gb._inputs(SMALL, 123, "varlen", [50, 73])["input_ids"].shape[1] == 123
