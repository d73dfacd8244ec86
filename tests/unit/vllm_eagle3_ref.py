"""vLLM 0.26's EAGLE-3 Llama drafter (vllm/model_executor/models/llama_eagle3.py, Eagle3LlamaForCausalLM), written
again in plain torch from that file, for one draft step over a sequence, from an exported draft folder as vLLM reads
it (config.json through speculators/algos.py update_eagle3: norm_before_residual True unless given; fc_norm,
norm_output, norm_before_fc False unless given). A test oracle: no vLLM import, float32 throughout.

    combine_hidden_states: [input_norm if norm_before_fc] -> [fc_norm per aux chunk if fc_norm] -> fc
    layer 0:  embeds = input_layernorm(embeds)
              norm_before_residual: h = hidden_norm(h); residual = h    else: residual = h; h = hidden_norm(h)
              attention(cat[embeds, h]) (q/k/v from 2H, RoPE neox, causal, GQA) -> o_proj
              residual = attn + residual; h = post_attention_layernorm(residual); h = mlp(h)
    final:    residual = h + residual; normed = norm(residual); logits = lm_head(normed) (draft vocabulary)
              the state fed to the next step: normed if norm_output else residual (the pre-norm sum)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def read(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = Path(folder)
    top = json.loads((folder / "config.json").read_text())
    layer = top["transformer_layer_config"]
    cfg = {
        "H": layer["hidden_size"],
        "heads": layer["num_attention_heads"],
        "kv": layer["num_key_value_heads"],
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        "eps": layer["rms_norm_eps"],
        "theta": (layer.get("rope_parameters") or {}).get("rope_theta") or layer.get("rope_theta") or 10000.0,
        "n_aux": layer.get("num_aux_hidden_states", 3),
        "norm_before_residual": top.get("norm_before_residual", True),
        "norm_before_fc": top.get("norm_before_fc", False),
        "fc_norm": top.get("fc_norm", False),
        "norm_output": top.get("norm_output", False),
    }
    w = {
        k: (t.float() if t.is_floating_point() else t) for k, t in load_file(str(folder / "model.safetensors")).items()
    }
    return cfg, w


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D], neox style (rotate the two halves), as vLLM's get_rope for Llama."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]  # [T, D/2]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def fuse(w: dict, aux: torch.Tensor, n_aux: int, eps: float, fc_norm: bool, norm_before_fc: bool = False):
    """combine_hidden_states: aux [T, n_aux * H_target] -> [T, H] (deepseek_eagle3.py's is this without input_norm)."""
    if norm_before_fc:
        aux = rms(aux, w["input_norm.weight"], eps)
    if fc_norm:
        aux = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(aux.chunk(n_aux, dim=-1))], dim=-1)
    return aux @ w["fc.weight"].T


def combine(cfg: dict, w: dict, aux: torch.Tensor) -> torch.Tensor:
    return fuse(w, aux, cfg["n_aux"], cfg["eps"], cfg["fc_norm"], cfg["norm_before_fc"])


def layer_input(w: dict, eps: float, embeds: torch.Tensor, hidden: torch.Tensor, norm_before_residual: bool):
    """The first layer's input cat[input_layernorm(embeds), hidden_norm(hidden)] [T, 2H] and its residual [T, H]
    (the same in llama_eagle3.py and deepseek_eagle3.py)."""
    p = "layers.0."
    e = rms(embeds, w[p + "input_layernorm.weight"], eps)
    if norm_before_residual:
        h = rms(hidden, w[p + "hidden_norm.weight"], eps)
        residual = h
    else:
        residual = hidden
        h = rms(hidden, w[p + "hidden_norm.weight"], eps)
    return torch.cat([e, h], dim=-1), residual


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k [T, heads, d], v [T, heads, d_v] -> [T, heads * d_v]."""
    t = q.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)


def layer_output(w: dict, eps: float, attn: torch.Tensor, residual: torch.Tensor, norm_output: bool):
    """After o_proj: the residual add, the MLP, the final norm -> (logits [T, draft vocab], the state fed to the next
    step)."""
    p = "layers.0."
    residual = attn + residual
    h = rms(residual, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    residual = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T + residual
    normed = rms(residual, w["norm.weight"], eps)
    return normed @ w["lm_head.weight"].T, (normed if norm_output else residual)


def step(cfg: dict, w: dict, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
    """One draft step over T positions: embeds, hidden [T, H] -> (logits [T, draft vocab], state for the next step)."""
    a, eps = "layers.0.self_attn.", cfg["eps"]
    x, residual = layer_input(w, eps, embeds, hidden, cfg["norm_before_residual"])
    t, nh, nkv, d = x.shape[0], cfg["heads"], cfg["kv"], cfg["head_dim"]
    q = rope((x @ w[a + "q_proj.weight"].T).view(t, nh, d), positions, cfg["theta"])
    k = rope((x @ w[a + "k_proj.weight"].T).view(t, nkv, d), positions, cfg["theta"])
    v = (x @ w[a + "v_proj.weight"].T).view(t, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    attn = causal_attention(q, k, v, 1 / math.sqrt(d)) @ w[a + "o_proj.weight"].T
    return layer_output(w, eps, attn, residual, cfg["norm_output"])
