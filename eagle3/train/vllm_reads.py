"""What vLLM 0.26 reads from an exported draft folder, field by field, with the source line each comes from.

A draft is served with ``speculative_config={"method": "eagle3", "model": DRAFT}``. vLLM parses DRAFT/config.json
(speculators format) in vllm/transformers_utils/configs/speculators/:
  base.py  extract_transformers_pre_trained_config: the hf_config starts as ``transformer_layer_config``
  algos.py update_eagle3: adds draft_vocab_size, target_hidden_size (if given), norm_before_residual (default
           True!), norm_before_fc, fc_norm, norm_output (default False), eagle_aux_hidden_state_layer_ids, and
           architectures from transformer_layer_config.model_type (llama -> Eagle3LlamaForCausalLM)
  base.py  build_vllm_speculative_config: num_speculative_tokens = speculators_config.proposal_methods[0]
           .speculative_tokens
then builds the drafter (vllm/model_executor/models/llama_eagle3.py) and taps the target:
  llama_eagle3.py:176-182  num_aux_hidden_states = hf_config.num_aux_hidden_states, else
           eagle_config["eagle_aux_hidden_state_layer_ids"], else 3: the speculators format has no eagle_config,
           so a draft with other than 3 aux layers must say num_aux_hidden_states in transformer_layer_config
  llama_eagle3.py:184-187  fc input = target_hidden_size (else hidden_size) x num_aux_hidden_states
  llama_eagle3.py:278-305  lm_head and d2t sized draft_vocab_size (absent: vocab_size)
  v1/worker/gpu_model_runner.py:5461  the target's aux layers = hf_config.eagle_aux_hidden_state_layer_ids
           (absent: the model's defaults, which is vLLM #50170's silent failure)
  config/speculative.py:843  the draft runs in the target's dtype (the exported dtype is the file's)

``reads(folder)`` is that view as a dict; ``problems(folder)`` lists where the weights disagree with it. On a host
with vLLM, tests/unit/test_vllm_contract.py checks ``reads`` against vLLM's own parser on the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path


def reads(folder: str | Path) -> dict:
    """The fields vLLM 0.26 takes from DRAFT/config.json, resolved with vLLM's defaults."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    layer = dict(cfg.get("transformer_layer_config") or {})
    spec = cfg.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    n_aux = layer.get("num_aux_hidden_states") or 3  # llama_eagle3.py:176-182 (no eagle_config in this format)
    target_hidden = cfg.get("target_hidden_size") or hidden
    return {
        "method": cfg.get("speculators_model_type"),
        "architecture": {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}.get(
            layer.get("model_type", "llama")
        ),
        "num_speculative_tokens": methods[0].get("speculative_tokens"),
        "verifier": (spec.get("verifier") or {}).get("name_or_path"),
        "aux_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
        "num_aux_hidden_states": int(n_aux),
        "target_hidden_size": int(target_hidden),
        "fc_input_size": int(target_hidden) * int(n_aux),
        "draft_vocab_size": int(cfg.get("draft_vocab_size") or layer["vocab_size"]),
        "vocab_size": int(layer["vocab_size"]),
        "norm_before_residual": cfg.get("norm_before_residual", True),
        "norm_before_fc": cfg.get("norm_before_fc", False),
        "fc_norm": cfg.get("fc_norm", False),
        "norm_output": cfg.get("norm_output", False),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or hidden // heads),
        "intermediate_size": int(layer["intermediate_size"]),
        "num_hidden_layers": int(layer.get("num_hidden_layers", 1)),
        "rope_theta": float(
            (layer.get("rope_parameters") or {}).get("rope_theta") or layer.get("rope_theta") or 10000.0
        ),
        "dtype": layer.get("torch_dtype") or layer.get("dtype") or cfg.get("torch_dtype"),
    }


def tensor_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of DRAFT/model.safetensors, from its header alone."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    return out


def mla_problems(folder: str | Path) -> list[str]:
    """The MLA draft (Eagle3DeepseekV3ForCausalLM, deepseek_eagle3.py + DeepseekV2MLAAttention): the tensors vLLM
    builds from config.json against the file's."""
    c, t = json.loads((Path(folder) / "config.json").read_text()), tensor_shapes(folder)
    h, nh, qk = c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    p = "layers.0.self_attn."
    want = {
        "fc.weight": (h, c["target_hidden_size"] * c["num_aux_hidden_states"]),
        "lm_head.weight": (c["draft_vocab_size"], h),
        p + "kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], 2 * h),
        p + "kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
        p + "o_proj.weight": (h, nh * c["v_head_dim"]),
        "layers.0.mlp.down_proj.weight": (h, c["intermediate_size"]),
    }
    if c.get("q_lora_rank"):
        want.update(
            {p + "q_a_proj.weight": (c["q_lora_rank"], 2 * h), p + "q_b_proj.weight": (nh * qk, c["q_lora_rank"])}
        )
    else:
        want[p + "q_proj.weight"] = (nh * qk, 2 * h)
    if c.get("fc_norm"):
        want.update({f"fc_norm.{i}.weight": (c["target_hidden_size"],) for i in range(c["num_aux_hidden_states"])})
    if c["draft_vocab_size"] < c["vocab_size"]:
        want["d2t"] = (c["draft_vocab_size"],)
    out = [
        f"{k}: the file has {t[k][0] if k in t else 'no such tensor'}, vLLM builds {v}"
        for k, v in want.items()
        if t.get(k, (None,))[0] != v
    ]
    if c.get("architectures") != ["Eagle3DeepseekV3ForCausalLM"]:
        out.append(f"architectures {c.get('architectures')}: vLLM builds the MLA draft as Eagle3DeepseekV3ForCausalLM")
    if len(c.get("eagle_aux_hidden_state_layer_ids") or []) != c["num_aux_hidden_states"]:
        out.append("eagle_aux_hidden_state_layer_ids and num_aux_hidden_states disagree")
    if c.get("model_type") in ("deepseek_v3", "deepseek_v32"):  # config/speculative.py hf_config_override
        out.append(
            f"model_type {c['model_type']}: vLLM 0.26 takes the draft for a DeepSeek MTP model; write deepseek_v2"
        )
    target_heads = (c.get("eagle3_mla") or {}).get("target_heads")
    if target_heads and nh != target_heads:  # MLACommonMetadataBuilder: the target's heads for every MLA layer
        out.append(
            f"num_attention_heads {nh}, the target's {target_heads}: vLLM 0.26 builds the MLA attention "
            "metadata from the target's heads (FA3 MLA fails at the first decode: 'scheduler_metadata must "
            "have shape')"
        )
    rs = c.get("rope_scaling") or {}
    if "factor" not in rs or "rope_theta" not in rs:  # deepseek_eagle3.py builds deepseek_yarn from rope_scaling
        out.append(
            "rope_scaling without factor or rope_theta: vLLM 0.26 builds the MLA draft's RoPE as deepseek_yarn "
            "from it (KeyError 'factor'; base 10000 without rope_theta)"
        )
    return out


def problems(folder: str | Path) -> list[str]:
    """Where DRAFT/model.safetensors disagrees with what vLLM builds from DRAFT/config.json (empty: none)."""
    if json.loads((Path(folder) / "config.json").read_text()).get("eagle3_mla"):
        return mla_problems(folder)
    r, t = reads(folder), tensor_shapes(folder)
    q_out = r["num_attention_heads"] * r["head_dim"]
    want = {
        "fc.weight": (r["hidden_size"], r["fc_input_size"]),
        "lm_head.weight": (r["draft_vocab_size"], r["hidden_size"]),
        "layers.0.self_attn.q_proj.weight": (q_out, 2 * r["hidden_size"]),  # the layer takes [embeds, hidden]
        "layers.0.self_attn.k_proj.weight": (r["num_key_value_heads"] * r["head_dim"], 2 * r["hidden_size"]),
        "layers.0.mlp.down_proj.weight": (r["hidden_size"], r["intermediate_size"]),
    }
    if r["draft_vocab_size"] < r["vocab_size"]:
        want["d2t"] = (r["draft_vocab_size"],)
    if r["fc_norm"]:  # llama_eagle3.py: one RMSNorm per aux state before fc (EAGLE-3.1)
        want.update({f"fc_norm.{i}.weight": (r["target_hidden_size"],) for i in range(r["num_aux_hidden_states"])})
    if r["norm_before_fc"]:
        want["input_norm.weight"] = (r["fc_input_size"],)
    out = [
        f"{k}: the file has {t[k][0] if k in t else 'no such tensor'}, vLLM builds {v}"
        for k, v in want.items()
        if t.get(k, (None,))[0] != v
    ]
    if not r["fc_norm"] and any(k.startswith("fc_norm.") for k in t):
        out.append("the file has fc_norm weights but config.json says fc_norm false: vLLM would skip them")
    if r["aux_layer_ids"] is None:
        out.append("eagle_aux_hidden_state_layer_ids missing: vLLM would tap its default layers")
    elif len(r["aux_layer_ids"]) != r["num_aux_hidden_states"]:
        out.append(
            f"{len(r['aux_layer_ids'])} aux layer ids but vLLM sizes fc for {r['num_aux_hidden_states']} "
            "(transformer_layer_config.num_aux_hidden_states)"
        )
    return out
