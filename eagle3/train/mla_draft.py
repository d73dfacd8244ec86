"""The MLA draft: the EAGLE-3 layer vLLM 0.26 serves as Eagle3DeepseekV3ForCausalLM (deepseek_eagle3.py): DeepSeek's
multi-head latent attention (MLA) and a dense MLP, for DeepseekV3 targets such as Kimi-K2.5.

Trained inside speculators' Eagle3DraftModel (its TTT loop, loss, vocabulary mapping, fc and norms): its first decoder
layer is replaced by MLADecoderLayer. Parameter names are those vLLM loads (layers.0.self_attn.q_a_proj, ...);
vLLM fuses q_a_proj + kv_a_proj_with_mqa and gate + up itself.

Per token, x = cat(input_layernorm(embeds), hidden_norm(hidden)) [2H]:
  q  = q_b_proj(q_a_layernorm(q_a_proj(x)))           [heads, nope + rope]
  kv = kv_a_proj_with_mqa(x) = (c [kv_lora], k_pe [rope], shared by the heads)
  k_nope, v = kv_b_proj(kv_a_layernorm(c))            [heads, nope], [heads, v]
  RoPE on q_pe and k_pe, GPT-J style (pairs 2i, 2i+1: vLLM's is_neox_style=False); DeepSeek-YaRN where the target has
  rope_scaling (inv_freq blended by the correction ramp at original_max_position_embeddings; cos/sin x
  mscale(factor, mscale) / mscale(factor, mscale_all_dim); softmax scale x mscale(factor, mscale_all_dim)^2)
  attention over k = cat(k_nope, k_pe), scale (nope + rope)^-0.5, then o_proj [heads * v -> H]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # speculators' Llama layer uses them too

from eagle3.train.draft import SERVE_TPS, DraftShapeError


@dataclass(frozen=True)
class MLAShape:
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    target_heads: int = 0  # the target's attention heads (0: not recorded); the draft must have as many

    @classmethod
    def for_target(cls, target_config: dict) -> MLAShape:
        """The target's own MLA sizes (Kimi-K2.5: 64 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128), its
        dense MLP width and RoPE. The heads are the target's, not more: vLLM 0.26 builds every MLA layer's attention
        metadata from the target's head count (MLACommonMetadataBuilder: model_config.get_num_attention_heads), and
        FA3 MLA fails a draft with other heads at its first decode ("scheduler_metadata must have shape
        (metadata_size)": a 16-head draft on a 4-head target, 2026-12-04, H200, vLLM 0.26.0)."""
        t = target_config.get("text_config") or target_config
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim") if k not in t]
        if missing:
            raise DraftShapeError(
                f"--draft-arch mla needs an MLA target (DeepseekV2/V3, Kimi); its config has no {', '.join(missing)}"
            )
        return cls(
            int(t["hidden_size"]),
            int(t["num_attention_heads"]),
            t.get("q_lora_rank"),
            int(t["kv_lora_rank"]),
            int(t["qk_nope_head_dim"]),
            int(t["qk_rope_head_dim"]),
            int(t["v_head_dim"]),
            int(t.get("intermediate_size") or 4 * t["hidden_size"]),
            float(t.get("rms_norm_eps", 1e-6)),
            float(t.get("rope_theta") or 10000.0),
            dict(t["rope_scaling"]) if t.get("rope_scaling") else None,
            int(t.get("max_position_embeddings", 4096)),
            int(t["num_attention_heads"]),
        )

    def check_servable(self, serve_tps=SERVE_TPS) -> None:
        bad = [tp for tp in serve_tps if self.num_attention_heads % tp]
        if bad:
            either = " either (vLLM serves neither there)" if self.num_attention_heads == self.target_heads else ""
            whose = "the target's own " if either else ""
            raise DraftShapeError(
                f"MLA draft: {whose}{self.num_attention_heads} heads do not split over TP {bad}"
                f"{either}; vLLM's DeepseekV2MLAAttention asserts num_heads % tp == 0: pass "
                "--serve-tp with TPs that divide them"
            )

    def layer_matmul_params(self) -> int:
        """Weights of the layer's matmuls: q_a + q_b (or q), kv_a_proj_with_mqa, kv_b, o, and the MLP's three."""
        h, nh = self.hidden_size, self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = self.q_lora_rank * (2 * h + nh * qk) if self.q_lora_rank else 2 * h * nh * qk
        kv = 2 * h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * nh * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        return q + kv + nh * self.v_head_dim * h + 3 * h * self.intermediate_size

    def params(self, n_aux: int, draft_vocab: int, target_hidden: int | None = None) -> int:
        """Parameters of the draft vLLM loads (no embedding: it shares the target's): fc, the layer's matmuls, its
        norms (q_a, kv_a, input, hidden, post-attention, final) and lm_head."""
        h = self.hidden_size
        norms = (self.q_lora_rank or 0) + self.kv_lora_rank + 4 * h
        return n_aux * (target_hidden or h) * h + self.layer_matmul_params() + norms + draft_vocab * h


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def serve_tps(shape: MLAShape, asked: tuple[int, ...] | None) -> tuple[int, ...]:
    """The TPs the export is checked at: those asked for, or by default those of SERVE_TPS the target's (= the
    draft's) heads split over (a 4-head target is served at TP 1, 2, 4 and nowhere else)."""
    return tuple(asked) if asked else tuple(tp for tp in SERVE_TPS if shape.num_attention_heads % tp == 0)


def rope_tables(shape: MLAShape) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [rope / 2], cos/sin multiplier, softmax scale) as vLLM builds them for this shape."""
    d, base, rs = shape.qk_rope_head_dim, shape.rope_theta, shape.rope_scaling
    scale = (shape.qk_nope_head_dim + shape.qk_rope_head_dim) ** -0.5
    pos = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    if not rs:
        return 1.0 / pos, 1.0, scale
    factor, orig = float(rs["factor"]), int(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

    def corr(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float) - low) / ((high + 0.001 if low == high else high) - low)).clamp(
        0, 1
    )
    keep = (1 - ramp) * rs.get("extrapolation_factor", 1)
    inv = (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
    mult = (
        yarn_mscale(factor, rs.get("mscale", 1))
        / yarn_mscale(factor, rs.get("mscale_all_dim", 0))
        * rs.get("attn_factor", 1)
    )
    m_all = yarn_mscale(factor, rs.get("mscale_all_dim", 0))
    return inv, mult, scale * m_all * m_all


def rope_gptj(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mult: float) -> torch.Tensor:
    """x [B, heads, T, rope]; positions [B, T]: rotate the pairs (2i, 2i+1)."""
    ang = positions.float()[:, None, :, None] * inv_freq.to(x.device)  # [B, 1, T, rope/2]
    cos, sin = (ang.cos() * mult).to(x.dtype), (ang.sin() * mult).to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, shape: MLAShape, attn_impl: str = "sdpa"):
        super().__init__()
        s, h, nh = shape, shape.hidden_size, shape.num_attention_heads
        self.shape, self.attn_impl, self.layer_idx = s, attn_impl, 0
        self.num_key_value_groups, self.is_causal = 1, True  # read by transformers' attention functions
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * h, s.q_lora_rank, bias=False)
            self.q_a_layernorm = LlamaRMSNorm(s.q_lora_rank, eps=s.rms_norm_eps)
            self.q_b_proj = nn.Linear(s.q_lora_rank, nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(2 * h, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, s.kv_lora_rank + s.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(s.kv_lora_rank, eps=s.rms_norm_eps)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, nh * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * s.v_head_dim, h, bias=False)
        inv, self.rope_mult, self.scaling = rope_tables(s)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        s, (b, t, _) = self.shape, x.shape
        nh, nope, rope = s.num_attention_heads, s.qk_nope_head_dim, s.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if s.q_lora_rank else self.q_proj(x)
        q = q.view(b, t, nh, nope + rope).transpose(1, 2)  # [B, nh, T, nope + rope]
        c, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, nh, nope + s.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, s.v_head_dim], dim=-1)  # [B, nh, T, nope], [B, nh, T, v]
        q_pe = rope_gptj(q[..., nope:], position_ids, self.inv_freq, self.rope_mult)
        k_pe = rope_gptj(k_pe.view(b, 1, t, rope), position_ids, self.inv_freq, self.rope_mult)
        q = torch.cat([q[..., :nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, nh, t, rope)], dim=-1)
        if past_key_values is not None:  # speculators' TTT: each step's keys join the cache
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.attn_impl == "simple_flex_attention":
            from speculators.models.attention import flex_attention_forward as attend
        else:
            attend = ALL_ATTENTION_FUNCTIONS[self.attn_impl]
        out, _ = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(b, t, nh * s.v_head_dim))


class MLADecoderLayer(nn.Module):
    """speculators' first-layer contract: takes cat(embeds, hidden) [B, T, 2H], returns the layer's output [B, T, H]
    (the residual sum), as vLLM's DeepseekV2Eagle3DecoderLayer + the final norm's residual add."""

    def __init__(self, shape: MLAShape, norm_before_residual: bool = False, attn_impl: str = "sdpa"):
        super().__init__()
        h = shape.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=shape.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=shape.rms_norm_eps)
        self.self_attn = MLAAttention(shape, attn_impl)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=shape.rms_norm_eps)
        # gate_proj, up_proj, down_proj without bias, silu: vLLM's DeepseekV2MLP under the same names
        self.mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=shape.intermediate_size, hidden_act="silu"))

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        embeds, hidden = hidden_states.chunk(2, dim=-1)
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        h = residual + self.self_attn(x, attention_mask, position_ids, past_key_values, **kwargs)
        return h + self.mlp(self.post_attention_layernorm(h))


def install(model, shape: MLAShape, attn_impl: str = "sdpa") -> None:
    """Replace the first decoder layer of speculators' Eagle3DraftModel by the MLA layer; the config records the
    shape (checkpoints and the export read it back)."""
    nbr = bool(getattr(model.config, "norm_before_residual", False))
    ref = next(model.layers[0].parameters())
    model.layers[0] = MLADecoderLayer(shape, nbr, attn_impl).to(ref.device, ref.dtype)
    model.config.eagle3_mla = asdict(shape)


def hf_config(shape: MLAShape, spec_config: dict, dtype: str) -> dict:
    """config.json for vLLM 0.26's Eagle3DeepseekV3ForCausalLM (an HF-style draft folder: vLLM's speculators format
    maps only llama and qwen3 layers)."""
    layer = spec_config["transformer_layer_config"]
    ids = list(spec_config["eagle_aux_hidden_state_layer_ids"])
    # model_type deepseek_v2: vLLM 0.26 turns every draft of model_type deepseek_v3 into DeepSeekMTPModel
    # (config/speculative.py hf_config_override; "Eagle3DeepSeekMTPModel ... not supported")
    out = {
        "architectures": ["Eagle3DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_attention_heads,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "intermediate_size": shape.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": int(layer["vocab_size"]),
        "draft_vocab_size": int(spec_config["draft_vocab_size"]),
        "target_hidden_size": int(spec_config.get("target_hidden_size") or shape.hidden_size),
        "num_aux_hidden_states": len(ids),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
        "norm_before_residual": bool(spec_config.get("norm_before_residual", False)),
        "fc_norm": bool(spec_config.get("fc_norm", False)),
        "norm_output": bool(spec_config.get("norm_output", False)),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "num_speculative_tokens": spec_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
        "eagle3_mla": asdict(shape),
    }
    out["rope_scaling"] = served_rope_scaling(shape)
    return out


def served_rope_scaling(shape: MLAShape) -> dict:
    """The rope_scaling the export writes: the target's YaRN, or for a plain-RoPE target a DeepSeek-YaRN of factor 1
    (the same tables: interpolation and extrapolation coincide, mscale 1), both carrying rope_theta. vLLM 0.26 builds
    the MLA draft's RoPE as deepseek_yarn from whatever config.rope_scaling returns, and under transformers 5 a config
    without rope_scaling returns its default rope dict: deepseek_yarn without a factor, KeyError 'factor' (seen on the
    H200); with no rope_theta in it, get_rope would take base 10000."""
    if shape.rope_scaling:
        return dict(shape.rope_scaling, rope_theta=shape.rope_theta)
    return {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": shape.max_position_embeddings,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": shape.rope_theta,
    }
