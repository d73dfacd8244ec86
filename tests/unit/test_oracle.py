"""The hf backend against references it does not share code with (issue 16): layer-by-layer runs of the tiny
DeepseekV3 and Llama targets, and a Llama forward written by hand from the weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3.data.conversations import random_samples
from eagle3.extract.hf_backend import HFBackend

from .oracle import layerwise_states, llama_by_hand

L = 8
SAMPLES = random_samples(4, [37, 5, 64, 20], 1024, seed=13)


@pytest.mark.parametrize("target", ["tiny_kimi", "tiny_llama"])
def test_hf_backend_states_are_each_layers_input_and_the_last_output_before_the_norm(request, target):
    folder = request.getfixturevalue(target)
    backend = HFBackend(folder, tuple(range(L + 1)), compute_dtype="float32", out_dtype="float32")
    got = backend.capture(SAMPLES)  # per sample [L + 1, T, H]
    for s, g in zip(SAMPLES, got):
        ref = layerwise_states(backend.model, s.input_ids)
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
        # the reference's id L really is pre-norm: the final norm of it is what HF reports as hidden_states[L]
        with torch.inference_mode():
            hs = backend.model(input_ids=torch.tensor([s.input_ids]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(backend.stack.norm(ref[L][None])[0], hs[L][0].float(), atol=1e-5, rtol=1e-5)
        assert (ref[L] - hs[L][0]).abs().max() > 1e-2  # and differs from it


def test_a_llama_written_by_hand_agrees_with_the_layerwise_reference(tiny_llama):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_llama / "config.json").read_text())
    weights = load_file(str(tiny_llama / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for s in SAMPLES:
        by_hand = llama_by_hand(weights, cfg, s.input_ids)
        torch.testing.assert_close(by_hand, layerwise_states(model, s.input_ids), atol=2e-4, rtol=2e-4)
