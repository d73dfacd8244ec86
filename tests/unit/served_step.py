"""What the drafter-forward tests (test_draft_forward, test_mla_draft) share: one draft step of the trainer's
checkpoint under speculators' forward, and its comparison with vLLM's drafter step written again (vllm_eagle3_ref,
vllm_mla_ref) on the published folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def training_step(ckpt, input_ids, aux, positions):
    """speculators' Eagle3DraftModel (with the MLA layer where the checkpoint records one) on the checkpoint's weights,
    rounded to the published dtype (bf16) and run in float32: (model, step 0's logits, the state it hands step 1)."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from eagle3.train import mla_draft

    config = Eagle3SpeculatorConfig.from_pretrained(ckpt)
    config.transformer_layer_config._attn_implementation = "sdpa"  # as the trainer runs it (TrainConfig.attn_impl)
    model = Eagle3DraftModel(config)
    mla = json.loads((Path(ckpt) / "config.json").read_text()).get("eagle3_mla")
    if mla:
        mla_draft.install(model, mla_draft.MLAShape(**mla))
    missing, unexpected = model.load_state_dict(load_file(str(Path(ckpt) / "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "verifier_")) for k in missing), (missing, unexpected)
    model.load_verifier_weights()  # the target's embedding: vLLM shares it too
    model = model.float().eval()
    for p in model.parameters():
        p.data = p.data.bfloat16().float()
    seen = {"logits": [], "layer_in": []}
    model.lm_head.register_forward_hook(lambda m, a, o: seen["logits"].append(o))
    model.layers[0].register_forward_pre_hook(lambda m, a: seen["layer_in"].append(a[0]))
    with torch.no_grad():
        model(
            input_ids=input_ids,
            hidden_states=aux,
            position_ids=positions,
            ttt_steps=2,
            document_ids=torch.zeros_like(input_ids),
        )
    h = model.embed_tokens.weight.shape[1]
    return model, seen["logits"][0][0], seen["layer_in"][1][0, :, h:]


def assert_served_step_is_the_trained_one(ckpt, ref, cfg: dict, w: dict, aux_width: int, t: int) -> None:
    """On t random tokens and aux states [t, aux_width]: the logits and the next step's state agree within 2e-4."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 1000, (1, t), generator=g)
    aux = torch.randn(1, t, aux_width, generator=g) * 3
    positions = torch.arange(1, t + 1)[None]
    model, logits, carried = training_step(ckpt, input_ids, aux, positions)
    embeds = model.embed_tokens.weight[input_ids[0]].float()
    want_logits, want_state = ref.step(cfg, w, embeds, ref.combine(cfg, w, aux[0]), positions[0])
    torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(carried, want_state, atol=2e-4, rtol=2e-4)
