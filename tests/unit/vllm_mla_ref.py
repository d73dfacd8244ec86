"""vLLM 0.26's MLA EAGLE-3 drafter (deepseek_eagle3.py: Eagle3DeepseekV2ForCausalLM with DeepseekV2MLAAttention,
deepseek_v2.py; RoPE from rotary_embedding/deepseek_scaling_rope.py and common.py), written again in plain torch from
those files for one draft step over a sequence, from an exported HF-style draft folder. A test oracle, float32.

  combine: [fc_norm per aux chunk if fc_norm] -> fc
  layer:   embeds = input_layernorm(embeds); norm_before_residual ? (h = hidden_norm(h); residual = h)
           : (residual = h; h = hidden_norm(h)); x = cat[embeds, h]
           MLA(x): q = q_b(q_a_layernorm(q_a(x))) | q_proj(x); c, k_pe = kv_a_proj_with_mqa(x);
                   k_nope, v = kv_b(kv_a_layernorm(c)); RoPE GPT-J (is_neox_style=False) on q_pe, k_pe;
                   softmax(q.k * scaling) v -> o_proj; scaling = (nope + rope)^-0.5 (x mscale_all_dim^2 on yarn)
           residual = attn + residual; h = mlp(post_attention_layernorm(residual))
  final:   residual = h + residual; normed = norm(residual); logits = lm_head(normed); next: normed | residual
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from .vllm_eagle3_ref import causal_attention, fuse, layer_input, layer_output, rms


def read(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    w = {
        k: (t.float() if t.is_floating_point() else t) for k, t in load_file(str(folder / "model.safetensors")).items()
    }
    return cfg, w


def _mscale(scale: float, m: float = 1.0) -> float:  # deepseek_scaling_rope.yarn_get_mscale
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_cache(cfg: dict) -> tuple[torch.Tensor, float, float]:
    """(inv_freq, cos/sin multiplier, attention scaling): get_rope's default or deepseek_yarn branch."""
    rs = cfg.get("rope_scaling")
    # deepseek_eagle3.py: rope_parameters = rope_scaling + deepseek_yarn (or {"rope_type": "default"}); get_rope's base
    # is rope_parameters.get("rope_theta", 10000), not the config's rope_theta
    d, base = cfg["qk_rope_head_dim"], (rs or {}).get("rope_theta", 10000)
    scaling = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    if not rs:
        return 1.0 / pos_freqs, 1.0, scaling
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]  # get_rope passes the original length

    def correction_dim(rotations):  # common.yarn_find_correction_dim
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(rs.get("beta_slow", 1))), d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = (1 - ramp) * rs.get("extrapolation_factor", 1)
    inv = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    mult = (
        _mscale(factor, rs.get("mscale", 1)) / _mscale(factor, rs.get("mscale_all_dim", 0)) * rs.get("attn_factor", 1)
    )
    m = _mscale(factor, rs.get("mscale_all_dim", False))  # DeepseekV2MLAAttention: scaling * mscale * mscale
    return inv, mult, scaling * m * m


def rope(x, positions, inv, mult):
    """x [T, heads, d]: GPT-J style, as common.rotate_gptj with cos/sin repeated per pair."""
    freqs = positions.float()[:, None] * inv[None]
    cos = (freqs.cos() * mult).repeat_interleave(2, dim=-1)[:, None]
    sin = (freqs.sin() * mult).repeat_interleave(2, dim=-1)[:, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def combine(cfg, w, aux):
    return fuse(w, aux, cfg["num_aux_hidden_states"], cfg["rms_norm_eps"], cfg.get("fc_norm", False))


def step(cfg, w, embeds, hidden, positions):
    a, eps, t = "layers.0.self_attn.", cfg["rms_norm_eps"], embeds.shape[0]
    nh, nope, rdim, vd = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    x, residual = layer_input(w, eps, embeds, hidden, cfg.get("norm_before_residual", False))
    if cfg.get("q_lora_rank"):
        q = rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps) @ w[a + "q_b_proj.weight"].T
    else:
        q = x @ w[a + "q_proj.weight"].T
    q = q.view(t, nh, nope + rdim)
    kv_a = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    c, k_pe = kv_a[:, : cfg["kv_lora_rank"]], kv_a[:, cfg["kv_lora_rank"] :]
    kv = (rms(c, w[a + "kv_a_layernorm.weight"], eps) @ w[a + "kv_b_proj.weight"].T).view(t, nh, nope + vd)
    inv, mult, scaling = rope_cache(cfg)
    q_pe = rope(q[..., nope:], positions, inv, mult)
    k_pe = rope(k_pe.view(t, 1, rdim), positions, inv, mult).expand(t, nh, rdim)
    qf, kf, v = torch.cat([q[..., :nope], q_pe], -1), torch.cat([kv[..., :nope], k_pe], -1), kv[..., nope:]
    attn = causal_attention(qf, kf, v, scaling) @ w[a + "o_proj.weight"].T
    return layer_output(w, eps, attn, residual, cfg.get("norm_output", False))
