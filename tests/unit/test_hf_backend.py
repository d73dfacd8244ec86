"""The hf reference backend: layer convention checked against a forward computed by hand."""

import math

import pytest
import torch
from safetensors.torch import load_file

from eagle3.data.conversations import random_samples
from eagle3.extract.hf_backend import HFBackend
from eagle3.targets import presets, tiny


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    """A 2-layer Llama with random weights (float32)."""
    return tiny.build_model(
        presets.from_name("tiny-llama"),
        tmp_path_factory.mktemp("llama2"),
        seed=3,
        with_tokenizer=False,
        overrides={"num_hidden_layers": 2},
    )


def manual_llama_states(path, ids):
    """Embeddings, then each layer by hand: RMSNorm, RoPE attention (GQA, causal), SwiGLU MLP.

    Returns [state id 0, id 1, id 2] = [embeddings, layer 0 output, layer 1 output before the final norm].
    """
    import json

    cfg = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    t = len(ids)
    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]  # [T, H]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(v):  # [T, heads, hd]
        return v * cos + torch.cat([-v[..., hd // 2 :], v[..., : hd // 2]], -1) * sin

    states = [x]
    for i in range(cfg["num_hidden_layers"]):
        w = {k[len(f"model.layers.{i}.") :]: v for k, v in sd.items() if k.startswith(f"model.layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = rope((h @ w["self_attn.q_proj.weight"].T).view(t, nh, hd))
        k = rope((h @ w["self_attn.k_proj.weight"].T).view(t, nkv, hd)).repeat_interleave(nh // nkv, 1)
        v = (h @ w["self_attn.v_proj.weight"].T).view(t, nkv, hd).repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * hd)
        x = x + att @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        x = (
            x
            + (torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T))
            @ w["mlp.down_proj.weight"].T
        )
        states.append(x)
    return states, rms(x, sd["model.norm.weight"])


def test_layer_convention_matches_a_hand_computed_forward(llama2):
    ids = list(random_samples(1, 23, 1024, seed=5)[0].input_ids)
    manual, normed = manual_llama_states(llama2, ids)
    backend = HFBackend(llama2, (0, 1, 2), compute_dtype="float32", out_dtype="float32")
    got = backend.forward_states(torch.tensor([ids]))[0]  # [3, T, H]
    for k in range(3):  # id k = input of layer k; id 2 = L = last layer output before the final norm
        torch.testing.assert_close(got[k], manual[k], rtol=1e-4, atol=1e-5)
    # HF's output_hidden_states[L] is *after* the final norm: taking it as id L is the classic trap.
    out = backend.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[2][0], normed, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out.hidden_states[2][0], manual[2], atol=1e-3)


def test_deepseek_states_equal_decoder_layer_outputs(tiny_kimi):
    """On the MLA+MoE model: id k+1 is decoder layer k's output (hooks), id 0 the embeddings."""
    backend = HFBackend(tiny_kimi, (1, 2, 5, 8), compute_dtype="float32", out_dtype="float32")
    outs = {}
    for i, layer in enumerate(backend.stack.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
    ids = torch.tensor([random_samples(1, 40, 1024, seed=2)[0].input_ids])
    got = backend.forward_states(ids)[0]
    for k, layer_id in enumerate((1, 2, 5, 8)):
        torch.testing.assert_close(got[k], outs[layer_id - 1][0], rtol=0, atol=0)


def test_capture_shapes_dtypes_and_distinct_layers(tiny_kimi):
    backend = HFBackend(tiny_kimi, (2, 4, 5, 8), out_dtype="bfloat16", batch_size=3)
    samples = random_samples(3, [17, 40, 9], 1024, seed=1)
    states = backend.capture(samples)
    for s, st in zip(samples, states):
        assert st.shape == (4, len(s), 128) and st.dtype == torch.bfloat16 and torch.isfinite(st).all()
        for a in range(4):
            for b in range(a + 1, 4):
                assert not torch.equal(st[a], st[b])
    # right padding in a batch of 3 leaves each sample's states as if it ran alone
    alone = HFBackend(tiny_kimi, (2, 4, 5, 8), out_dtype="bfloat16", batch_size=1).capture(samples)
    for a, b in zip(states, alone):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
