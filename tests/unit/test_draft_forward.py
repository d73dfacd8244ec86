"""The draft vLLM serves computes what the trainer trained: the trainer's weights under the training forward
(speculators' Eagle3DraftModel) and the published folder under vLLM 0.26's drafter forward give the same logits and
the same state for the next draft step (tests/unit/vllm_eagle3_ref.py, written from llama_eagle3.py), for EAGLE-3 and
each EAGLE-3.1 toggle
(fc_norm, norm_output). A weight layout or norm placement that differs between the two fails here, on CPU.

Later draft steps are not compared position for position: training (TTT) runs step s at the positions of step 0,
vLLM at the next positions, by design; what a step hands the next (the state compared here) is what both share."""

import pytest

from eagle3.train.train import TrainConfig, train

from . import vllm_eagle3_ref as ref
from .served_step import assert_served_step_is_the_trained_one


@pytest.fixture(scope="module")
def drafts(small_store, tmp_path_factory):
    """Drafts trained 4 steps at a high rate (every norm moved off 1) with each toggle: (the trainer's newest
    checkpoint, the draft published for vLLM)."""
    from eagle3.train import checkpoint

    out = {}
    for fc_norm, norm_output in ((False, False), (True, False), (False, True), (True, True)):
        tmp = tmp_path_factory.mktemp(f"draft-{int(fc_norm)}{int(norm_output)}")
        res = train(
            TrainConfig(
                store=str(small_store),
                out=str(tmp),
                draft_vocab_size=256,
                batch_samples=4,
                max_steps=4,
                lr=2e-2,
                seed=0,
                fc_norm=fc_norm,
                norm_output=norm_output,
            ),
            progress=False,
        )
        out[fc_norm, norm_output] = checkpoint.latest(tmp), res.draft
    return out


@pytest.mark.parametrize("fc_norm,norm_output", [(False, False), (True, False), (False, True), (True, True)])
def test_the_training_forward_is_vllm_s_drafter_forward(drafts, fc_norm, norm_output):
    trained, published = drafts[fc_norm, norm_output]
    cfg, w = ref.read(published)
    assert (cfg["fc_norm"], cfg["norm_output"]) == (fc_norm, norm_output)  # what vLLM will build
    norms = [k for k in w if k.endswith("norm.weight") or ".norm" in k]
    assert all((w[k] - 1).abs().max() > 1e-3 for k in norms), norms  # a misplaced norm shows
    assert_served_step_is_the_trained_one(trained, ref, cfg, w, cfg["n_aux"] * cfg["H"], 24)
    if fc_norm:
        assert any(k.startswith("fc_norm.") for k in w)
