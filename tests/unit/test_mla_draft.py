"""The MLA draft (`train --draft-arch mla`, eagle3/train/mla_draft.py): trained in speculators' TTT loop, published as
vLLM 0.26's Eagle3DeepseekV3ForCausalLM loads it, and computing there what it computed in training: the trainer's
checkpoint under the training forward against the published folder under vLLM's MLA drafter forward written again
(tests/unit/vllm_mla_ref.py), logits and the state fed to the next step, with and without EAGLE-3.1's toggles.
The RoPE (GPT-J pairs; DeepSeek-YaRN at Kimi-K2.5's rope_scaling) against the same written-again vLLM tables."""

import math
from pathlib import Path

import pytest
import torch

from eagle3 import cli
from eagle3.targets.presets import KIMI_K25_TEXT
from eagle3.train import checkpoint, mla_draft, vllm_reads
from eagle3.train.draft import DraftShapeError
from eagle3.train.train import TrainConfig, train

from . import vllm_mla_ref as ref
from .served_step import assert_served_step_is_the_trained_one

TOGGLES = ((False, False), (True, False), (False, True), (True, True))  # (fc_norm, norm_output): each alone, both


@pytest.fixture(scope="module")
def mla_drafts(small_store, tmp_path_factory):
    """tiny-kimi's store (an MLA target: kv_lora 32, rope 8, nope 16, v 16, q_lora 64): MLA drafts trained 4 steps at a
    high rate (every norm off 1), plain, with each of EAGLE-3.1's toggles alone and both: (checkpoint, published
    folder, result)."""
    out = {}
    for toggles in TOGGLES:
        tmp = tmp_path_factory.mktemp(f"mla-{int(toggles[0])}")
        res = train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp),
                draft_vocab_size=256,
                batch_samples=4,
                max_steps=4,
                lr=2e-2,
                seed=0,
                draft_arch="mla",
                fc_norm=toggles[0],
                norm_output=toggles[1],
            ),
            progress=False,
        )
        out[toggles] = checkpoint.latest(tmp), Path(res.draft), res
    return out


@pytest.mark.parametrize("toggles", TOGGLES)
def test_the_mla_draft_computes_in_vllm_what_it_computed_in_training(mla_drafts, toggles):
    ckpt, published, res = mla_drafts[toggles]
    cfg, w = ref.read(published)
    assert cfg["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and vllm_reads.problems(published) == []
    assert (cfg["fc_norm"], cfg["norm_output"]) == toggles and cfg["num_attention_heads"] == 4  # tiny-kimi's own
    assert math.isfinite(res.losses[-1]) and res.losses[-1] < res.losses[0]
    assert_served_step_is_the_trained_one(
        ckpt, ref, cfg, w, cfg["num_aux_hidden_states"] * cfg["target_hidden_size"], 20
    )


def test_rope_at_kimi_s_yarn_is_vllm_s_deepseek_yarn():
    shape = mla_draft.MLAShape.for_target(KIMI_K25_TEXT)
    inv, mult, scale = mla_draft.rope_tables(shape)
    want_inv, want_mult, want_scale = ref.rope_cache(
        {
            **{k: getattr(shape, k) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "rope_theta")},
            "rope_scaling": mla_draft.served_rope_scaling(shape),
        }
    )
    torch.testing.assert_close(inv, want_inv)
    assert (mult, scale) == pytest.approx((want_mult, want_scale))
    assert scale == pytest.approx(192**-0.5 * (0.1 * math.log(64) + 1) ** 2)  # mscale_all_dim 1, factor 64
    x = torch.randn(1, 2, 5, 64)
    pos = torch.tensor([[0, 1, 100, 4096, 200000]])
    torch.testing.assert_close(
        mla_draft.rope_gptj(x, pos, inv, mult)[0].transpose(0, 1),
        ref.rope(x[0].transpose(0, 1), pos[0], want_inv, want_mult),
        atol=1e-5,
        rtol=1e-5,
    )


def test_kimi_s_mla_draft_is_servable_at_tp_1_to_16_and_its_size():
    shape = mla_draft.MLAShape.for_target(KIMI_K25_TEXT)
    assert (shape.num_attention_heads, shape.q_lora_rank, shape.kv_lora_rank, shape.qk_rope_head_dim) == (
        64,
        1536,
        512,
        64,
    )
    shape.check_servable((1, 2, 4, 8, 16))
    assert shape.params(3, 32000) == 896_169_984  # 1.79 GB in bf16
    with pytest.raises(DraftShapeError, match=r"24 heads do not split over TP \[16\]"):
        mla_draft.MLAShape(**{**shape.__dict__, "num_attention_heads": 24}).check_servable((1, 2, 4, 8, 16))


def test_the_mla_draft_has_its_target_s_heads_as_vllm_s_attention_metadata_needs(mla_drafts, tmp_path):
    """vLLM 0.26 builds the MLA attention metadata of every layer, the draft's too, from the target's head count
    (MLACommonMetadataBuilder: model_config.get_num_attention_heads; FA3 MLA's scheduler metadata from it): a 16-head
    draft on a 4-head target died at its first decode on the H200 ("scheduler_metadata must have shape
    (metadata_size)"). The draft takes the target's heads; the export refuses other heads; the default TP check keeps
    the TPs the target itself splits over, and an asked-for TP it does not is refused with the reason."""
    import json
    import shutil

    assert mla_draft.MLAShape.for_target(dict(KIMI_K25_TEXT, num_attention_heads=4)).num_attention_heads == 4
    assert mla_draft.MLAShape.for_target(KIMI_K25_TEXT).num_attention_heads == 64
    _, published, _ = mla_drafts[(False, False)]
    bad = tmp_path / "bad"
    shutil.copytree(published, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=16)))
    assert any("num_attention_heads 16, the target's 4" in p for p in vllm_reads.problems(bad)), vllm_reads.problems(
        bad
    )
    shape = mla_draft.MLAShape.for_target(dict(KIMI_K25_TEXT, num_attention_heads=4))
    assert mla_draft.serve_tps(shape, None) == (1, 2, 4)
    with pytest.raises(DraftShapeError, match=r"the target's own 4 heads do not split over TP \[8\] either"):
        shape.check_servable((1, 8))


def test_mla_on_a_target_without_mla_is_refused_with_the_reason(tmp_path, tiny_llama, small_data, capsys):
    store = tmp_path / "s"
    assert (
        cli.main(
            [
                "extract",
                "--model",
                str(tiny_llama),
                "--data",
                str(small_data),
                "--out",
                str(store),
                "--max-samples",
                "4",
                "--max-len",
                "64",
                "--no-selfcheck",
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "train",
                "--store",
                str(store),
                "--out",
                str(tmp_path / "t"),
                "--steps",
                "1",
                "--batch",
                "4",
                "--draft-vocab",
                "128",
                "--draft-arch",
                "mla",
            ]
        )
        == 2
    )
    assert "--draft-arch mla needs an MLA target" in capsys.readouterr().err


def test_the_export_always_gives_vllm_a_yarn_it_can_build_with_the_target_s_theta():
    """vLLM 0.26 makes the MLA draft's RoPE deepseek_yarn from config.rope_scaling, which transformers 5 fills with a
    factor-less default dict when the config has none (KeyError 'factor' on the H200), and takes base 10000 unless
    rope_theta is in it. The export writes the target's YaRN, or an identity YaRN (factor 1: the same tables as plain
    RoPE), each with rope_theta: the tables vLLM builds from it are the training's."""
    target = dict(KIMI_K25_TEXT, rope_theta=50000.0)
    del target["rope_scaling"]
    plain = mla_draft.MLAShape.for_target(target)
    served = mla_draft.served_rope_scaling(plain)
    assert served["factor"] == 1.0 and served["rope_theta"] == 50000.0
    inv, mult, scale = mla_draft.rope_tables(plain)
    want_inv, want_mult, want_scale = ref.rope_cache(
        {"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "rope_theta": 50000.0, "rope_scaling": served}
    )
    torch.testing.assert_close(inv, want_inv)
    assert (mult, scale) == pytest.approx((want_mult, want_scale))
    kimi = mla_draft.MLAShape.for_target(KIMI_K25_TEXT)
    assert mla_draft.served_rope_scaling(kimi) == dict(KIMI_K25_TEXT["rope_scaling"], rope_theta=50000.0)
    assert (
        mla_draft.hf_config(
            kimi,
            {
                "transformer_layer_config": {"vocab_size": 163840},
                "draft_vocab_size": 32000,
                "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]},
            },
            "bfloat16",
        )["model_type"]
        == "deepseek_v2"
    )  # deepseek_v3 is taken for an MTP model
