"""Independent references for the hf backend (issue 16), so no CPU comparison checks a backend against itself.

- ``layerwise_states``: run the decoder layers one by one (embedding -> layer 0 -> ... -> layer L-1) and record
  each layer's input and the last layer's output. It shares transformers' layer modules with the hf backend but
  none of its bookkeeping: no output_hidden_states indexing, no final-norm hook.
- ``llama_by_hand``: a Llama forward written from the weights alone (RMSNorm, RoPE, grouped-query causal
  attention, SwiGLU), sharing no code with transformers.
Both return every id 0..L as [L + 1, T, H] float32: id k = input of layer k, id L = last layer's output, pre-norm.
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def layerwise_states(model, input_ids) -> torch.Tensor:
    stack = model.model
    ids = torch.tensor([list(input_ids)])
    h = stack.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    rope = stack.rotary_emb(h, position_ids=pos)
    out = [h[0]]
    for layer in stack.layers:
        h = layer(h, attention_mask=None, position_embeddings=rope, position_ids=pos)  # None: causal (sdpa)
        h = h[0] if isinstance(h, tuple) else h
        out.append(h[0])
    return torch.stack(out).float()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.inference_mode()
def llama_by_hand(weights: dict, cfg: dict, input_ids) -> torch.Tensor:
    w = {k: v.double() for k, v in weights.items()}
    T, H = len(input_ids), cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // nh
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 10000.0)
    eps = cfg["rms_norm_eps"]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(x):  # [heads, T, d], rotate-half RoPE
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = w["model.embed_tokens.weight"][torch.tensor(list(input_ids))]
    out = [h]
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, d).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, d).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, d).transpose(0, 1)
        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / d**0.5 + causal, -1) @ v
        h = h + att.transpose(0, 1).reshape(T, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        out.append(h)
    return torch.stack(out).float()
