"""The Llama draft's RoPE at long positions: the target's YaRN (theta, factor, original context, betas), as a
Llama config carries it, so speculators trains with the tables vLLM serves with at 4k, 16k and 32k positions.
DeepSeek's mscale keys stay out: transformers reads them as an attention factor of 1.0 where vLLM's "yarn" ignores
them and scales by 0.1 ln(factor) + 1 (1.416 for Kimi), a 0.42 difference in every cos and sin."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3.targets.presets import KIMI_K25_TEXT
from eagle3.train.draft import DraftShape

from .vllm_yarn_ref import cos_sin

KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip


def test_the_draft_takes_the_target_s_yarn_and_leaves_deepseek_s_mscale_keys_out():
    shape = DraftShape.for_target(KIMI_K25_TEXT)
    assert shape.llama_config().rope_parameters == KIMI_YARN
    plain = DraftShape.for_target(dict(KIMI_K25_TEXT, rope_scaling=None))
    assert plain.llama_config().rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    layer = shape.llama_config().to_dict()
    assert DraftShape.from_layer_config(layer) == shape  # the exported config reads back to the same draft


@pytest.mark.parametrize("position", [4096, 16384, 32768])
def test_the_draft_s_training_rope_is_vllm_s_at_long_positions(position):
    cfg = DraftShape.for_target(KIMI_K25_TEXT).llama_config()
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[position - 1, position, position + 7]])
    cos, sin = rope(torch.zeros(1, 1, cfg.head_dim), pos)
    half = cfg.head_dim // 2
    want_cos, want_sin = cos_sin(pos[0], cfg.head_dim, 50000.0, 64.0, 4096)
    assert torch.allclose(cos[0, :, :half], want_cos, atol=1e-5) and torch.allclose(
        sin[0, :, :half], want_sin, atol=1e-5
    )
    assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # neox halves, as vLLM's llama applies them


def test_the_reference_is_vllm_s_own_where_vllm_is_installed():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale
    from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import YaRNScalingRotaryEmbedding

    v = object.__new__(YaRNScalingRotaryEmbedding)  # its tables without a vLLM config (a CustomOp's __init__)
    v.scaling_factor, v.extrapolation_factor, v.attn_factor, v.beta_fast, v.beta_slow = 64.0, 1, 1, 32, 1
    v.truncate, v.mscale, v.head_size, v.rotary_dim = True, float(yarn_get_mscale(64.0)), 128, 128
    v.max_position_embeddings, v.base = 4096, 50000.0
    pos = torch.tensor([0, 4096, 16384, 32768, 262143])
    cache = v._compute_cos_sin_cache()[pos]
    want_cos, want_sin = cos_sin(pos, 128, 50000.0, 64.0, 4096)
    assert torch.allclose(cache[:, :64], want_cos, atol=1e-6) and torch.allclose(cache[:, 64:], want_sin, atol=1e-6)
