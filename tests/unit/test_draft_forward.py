"""The draft vLLM serves computes what the trainer trained: the trainer's weights under the training forward
(speculators' Eagle3DraftModel) and the published folder under vLLM 0.26's drafter forward give the same logits and
the same state for the next draft step (tests/unit/vllm_eagle3_ref.py, written from llama_eagle3.py), for EAGLE-3 and each EAGLE-3.1 toggle
(fc_norm, norm_output). A weight layout or norm placement that differs between the two fails here, on CPU.

Later draft steps are not compared position for position: training (TTT) runs step s at the positions of step 0,
vLLM at the next positions, by design; what a step hands the next (the state compared here) is what both share."""

from pathlib import Path

import pytest
import torch

from eagle3.train.train import TrainConfig, train

from . import vllm_eagle3_ref as ref


@pytest.fixture(scope="module")
def drafts(small_store, tmp_path_factory):
    """Drafts trained 4 steps at a high rate (every norm moved off 1) with each toggle: (the trainer's newest
    checkpoint, the draft published for vLLM)."""
    from eagle3.train import checkpoint

    out = {}
    for fc_norm, norm_output in ((False, False), (True, False), (False, True), (True, True)):
        tmp = tmp_path_factory.mktemp(f"draft-{int(fc_norm)}{int(norm_output)}")
        res = train(TrainConfig(store=str(small_store), out=str(tmp), draft_vocab_size=256, batch_samples=4,
                                max_steps=4, lr=2e-2, seed=0, fc_norm=fc_norm, norm_output=norm_output), progress=False)
        out[fc_norm, norm_output] = checkpoint.latest(tmp), res.draft
    return out


def _training_forward(folder, input_ids, aux, positions):
    """speculators' model on the trainer's checkpoint, its weights rounded to the published dtype (bf16) and run in
    float32: step 0's logits and the state it hands step 1."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"  # as the trainer runs it (TrainConfig.attn_impl)
    model = Eagle3DraftModel(config)
    missing, unexpected = model.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "verifier_")) for k in missing), (missing, unexpected)
    model.load_verifier_weights()  # the target's embedding: vLLM shares it too
    model = model.float().eval()
    for p in model.parameters():
        p.data = p.data.bfloat16().float()
    seen = {"logits": [], "layer_in": []}
    model.lm_head.register_forward_hook(lambda m, a, o: seen["logits"].append(o))
    model.layers[0].register_forward_pre_hook(lambda m, a: seen["layer_in"].append(a[0]))
    t = input_ids.shape[1]
    with torch.no_grad():
        model(input_ids=input_ids, hidden_states=aux, position_ids=positions, ttt_steps=2,
              document_ids=torch.zeros(1, t, dtype=torch.long))
    h = model.embed_tokens.weight.shape[1]
    return model, seen["logits"][0][0], seen["layer_in"][1][0, :, h:]


@pytest.mark.parametrize("fc_norm,norm_output", [(False, False), (True, False), (False, True), (True, True)])
def test_the_training_forward_is_vllm_s_drafter_forward(drafts, fc_norm, norm_output):
    trained, published = drafts[fc_norm, norm_output]
    cfg, w = ref.read(published)
    assert (cfg["fc_norm"], cfg["norm_output"]) == (fc_norm, norm_output)  # what vLLM will build
    norms = [k for k in w if k.endswith("norm.weight") or ".norm" in k]
    assert all((w[k] - 1).abs().max() > 1e-3 for k in norms), norms  # a misplaced norm shows
    g = torch.Generator().manual_seed(0)
    t = 24
    input_ids = torch.randint(5, 1000, (1, t), generator=g)
    aux = torch.randn(1, t, cfg["n_aux"] * cfg["H"], generator=g) * 3
    positions = torch.arange(1, t + 1)[None]
    model, logits, carried = _training_forward(trained, input_ids, aux, positions)
    embeds = model.embed_tokens.weight[input_ids[0]].float()
    want_logits, want_state = ref.step(cfg, w, embeds, ref.combine(cfg, w, aux[0]), positions[0])
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(carried, want_state, atol=2e-4, rtol=2e-4)
    if fc_norm:
        assert any(k.startswith("fc_norm.") for k in w)
